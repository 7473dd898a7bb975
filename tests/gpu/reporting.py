"""What every GPU check script shares: one JSON line per check, tagged with its family, the
selection of families (``--families``, which tests/gpu/test_gpu_suite.py passes), and the error
measure."""

import argparse
import json
import threading
import traceback

# The family of a record made outside any family (a worker's own failure, say).
OUTSIDE_FAMILIES = "launch"


def check_parser(doc: str | None, model: str | None, families,
                 results_required: bool = True) -> argparse.ArgumentParser:
    """The arguments every check script takes: --results (the JSON-lines file to append to),
    --model (this run's label in it) and --families (which of `families` to run; all by
    default). The script adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--results", required=results_required,
                        help="JSON-lines file to append to")
    parser.add_argument("--model", default=model, help="label of this run in the results")
    parser.add_argument("--families", nargs="+", choices=families, default=None, metavar="FAMILY",
                        help=f"run only these families of checks ({', '.join(families)}); "
                        "default: all")
    return parser


class Reporter:
    """Appends one JSON line per check, with the family of checks it belongs to; runs only the
    selected families. Safe across threads: each thread has its own current family."""

    def __init__(self, path: str, model: str, families=None):
        self.path, self.model, self.lock = path, model, threading.Lock()
        self.selected = None if families is None else frozenset(families)
        self.current = threading.local()

    def wants(self, family: str) -> bool:
        return self.selected is None or family in self.selected

    def family(self, family: str, checks, *args, **kwargs) -> None:
        """Runs checks(*args, **kwargs), the checks of `family`, if it is selected; what they
        record carries the family's name."""
        if not self.wants(family):
            return
        outer = getattr(self.current, "family", None)
        self.current.family = family
        try:
            checks(*args, **kwargs)
        finally:
            self.current.family = outer

    def check(self, name: str, body, rank: int = 0, traceback_limit: int = 6) -> None:
        """Records body()'s (ok, detail) as check `name`; a body that raises is a failed check
        whose detail is the traceback."""
        try:
            ok, detail = body()
        except Exception:
            ok, detail = False, traceback.format_exc(limit=traceback_limit)
        self.record(name, rank, bool(ok), detail)

    def record(self, name: str, rank: int, ok: bool, detail: str):
        family = getattr(self.current, "family", None) or OUTSIDE_FAMILIES
        line = json.dumps({"model": self.model, "family": family, "name": name, "rank": rank,
                           "ok": bool(ok), "detail": detail})
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")
        if not ok:
            print(f"FAIL [{self.model}] {name} rank {rank}: {detail}", flush=True)


def relative_error(out, ref) -> float:
    """‖out - ref‖ / ‖ref‖ of torch tensors, out in double; inf where out is not finite."""
    import torch  # here: the JAX checks import this module before JAX starts, without torch

    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison left somewhere, or an overflow
    return ((out.double() - ref).norm() / ref.norm()).item()
