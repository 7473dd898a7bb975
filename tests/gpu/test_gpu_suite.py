"""The GPU suite: a test per (process model, family of checks), and one per launch.

    python3 -m pytest tests/gpu -q                        # every model the visible GPUs allow
    python3 -m pytest tests/gpu -q -k "threads and graphs"   # one family of one model
    CUDA_VISIBLE_DEVICES=2,3 python3 -m pytest tests/gpu -q -k "processes-tp2 or threads"

Each selected model is launched once (torchrun workers, one process driving its GPUs, or the
processes a script starts), running only the families its selected tests name; a test passes when
every check of its family passed on every rank, and a launch's test when it exited 0 within its
limit. Models that need more GPUs than are visible are skipped. Logs and every rank's result go
to --log-dir (default $OUT/gpu-suite); tests/gpu/run.sh builds and runs it all.
"""

import pytest

import suite

CASES = [pytest.param(model, family, id=f"{model.name}-{family}")
         for model in suite.MODELS for family in (*model.families, suite.LAUNCH)]


@pytest.mark.parametrize("model,family", CASES)
def test_gpu(model, family, visible, launched):
    if not model.runs_on(len(visible)):
        pytest.skip(f"{model.name} needs {max(model.min_gpus, model.gpus or 0)} GPUs, "
                    f"{len(visible)} visible")
    verdict = suite.judge(launched(model), family)
    assert verdict.ok, verdict.message
