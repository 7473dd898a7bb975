"""mkdocs hook: the charts in bench/results/ become pages' images under results/, so the
documentation shows the committed charts without copying them into docs/."""

import glob
import os

from mkdocs.structure.files import File

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                       "results")


def on_files(files, config):
    for chart in sorted(glob.glob(os.path.join(RESULTS, "*.png"))):
        files.append(File.generated(config, f"results/{os.path.basename(chart)}",
                                    abs_src_path=chart))
    return files
