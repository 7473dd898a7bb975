"""pytest's side of the GPU suite: where logs go, one launch per model for all its selected
tests, and the per-check count at the end."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import suite  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--log-dir", default=os.path.join(os.environ.get("OUT", "/tmp"), "gpu-suite"),
                     help="the launches' logs and results.jsonl (every rank's result per check)")
    parser.addoption("--models", default=None,
                     help="comma-separated model names to run (default: all); -k also selects, "
                     "by substring")


def pytest_collection_modifyitems(config, items):
    names = config.getoption("--models")
    if names is None:
        return
    wanted = set(names.split(","))
    unknown = wanted - {model.name for model in suite.MODELS}
    if unknown:
        raise pytest.UsageError(f"--models: no model named {', '.join(sorted(unknown))}; the "
                                f"models: {', '.join(m.name for m in suite.MODELS)}")
    keep = [i for i in items if i.callspec.params["model"].name in wanted]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


@pytest.fixture(scope="session")
def log_dir(request):
    path = request.config.getoption("--log-dir")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def visible():
    import torch

    return suite.visible_gpus(torch.cuda.device_count())


@pytest.fixture(scope="session")
def launched(request, log_dir, visible):
    """launched(model): the model's launch, made on first use with the families this session's
    selected tests name (all of the model's when only its launch test is selected)."""
    results = os.path.join(log_dir, "results.jsonl")
    open(results, "w").close()
    request.config.stash[RESULTS] = results
    selected = {}
    for item in request.session.items:
        params = getattr(item, "callspec", None)
        if params is not None and "model" in params.params:
            selected.setdefault(params.params["model"].name, set()).add(params.params["family"])
    launches = {}

    def launch(model):
        if model.name not in launches:
            wanted = selected.get(model.name, set()) - {suite.LAUNCH}
            families = [f for f in model.families if f in wanted] or list(model.families)
            launches[model.name] = suite.launch(model, visible, families, log_dir, results)
        return launches[model.name]

    return launch


RESULTS = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, config):
    results = config.stash.get(RESULTS, None)
    if results is None:
        return
    records = []
    for model in suite.MODELS:
        records += [(model.name, r) for r in suite.read_records(results, model.name)]
    checks = {}
    for model, r in records:
        key = (model, r["name"])
        checks[key] = checks.get(key, True) and r["ok"]
    failed = sum(not ok for ok in checks.values())
    terminalreporter.write_line(f"checks: {len(checks) - failed} passed, {failed} failed "
                                f"({len(records)} rank results in {results})")
