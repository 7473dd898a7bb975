"""The GPU suite's harness (tests/gpu/suite.py, reporting.py) on a machine without GPUs: a fake
check script stands in for the real ones."""

import ast
import os
import sys
import textwrap
import time

import pytest

GPU_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu")
sys.path.insert(0, GPU_TESTS)
import suite  # noqa: E402

FAKE = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, {gpu_tests!r})
    from reporting import Reporter, check_parser
    parser = check_parser(None, "fake", ("alpha", "beta"))
    parser.add_argument("--behaviour", default="pass")
    args = parser.parse_args()
    report = Reporter(args.results, args.model, args.families)
    def alpha():
        report.record("alpha/one", 0, True, "fine")
        report.record("alpha/one", 1, args.behaviour != "fail", "rank 1 off by 3e-1")
    def beta():
        report.record("beta/one", 0, True, "fine")
    report.family("alpha", alpha)
    report.family("beta", beta)
    print("gpus", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    if args.behaviour == "warn":
        print("Producer process has been terminated before all shared CUDA tensors released")
    if args.behaviour == "crash":
        sys.exit(3)
    if args.behaviour == "hang":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(60)
""")


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "check_fake.py"
    script.write_text(FAKE.format(gpu_tests=GPU_TESTS))

    def run(behaviour="pass", families=("alpha", "beta"), timeout_s=60.0, gpus=None):
        model = suite.Model("fake", ("{python}", str(script), "--results", "{results}", "--model",
                                     "{model}", "--behaviour", behaviour), ("alpha", "beta"),
                            gpus=gpus, timeout_s=timeout_s,
                            log_must_not_contain=("shared CUDA tensors released",))
        results = str(tmp_path / "results.jsonl")
        return suite.launch(model, ["4", "5", "6"], list(families), str(tmp_path), results)

    return run


def test_every_family_passes_and_is_tagged(fake):
    launch = fake()
    assert launch.status == 0
    assert [suite.judge(launch, f).ok for f in ("alpha", "beta", suite.LAUNCH)] == [True] * 3
    records = suite.read_records(launch.results, "fake")
    assert {r["family"] for r in records} == {"alpha", "beta"}
    assert "gpus 4,5,6" in launch.log_tail()  # every visible GPU, in the order given


def test_only_the_selected_families_run(fake):
    launch = fake(families=["beta"], gpus=2)
    assert {r["family"] for r in suite.read_records(launch.results, "fake")} == {"beta"}
    verdict = suite.judge(launch, "alpha")
    assert not verdict.ok and "no alpha check ran" in verdict.message
    assert "gpus 4,5" in launch.log_tail()


def test_a_check_fails_when_one_rank_fails(fake):
    launch = fake("fail")
    verdict = suite.judge(launch, "alpha")
    assert not verdict.ok
    assert "1 of 1 alpha checks failed" in verdict.message
    assert "alpha/one (rank 1): rank 1 off by 3e-1" in verdict.message
    assert suite.judge(launch, "beta").ok


def test_a_crashed_launch_fails_its_launch_test_with_the_log(fake):
    launch = fake("crash")
    verdict = suite.judge(launch, suite.LAUNCH)
    assert not verdict.ok and "exited with status 3" in verdict.message
    assert "gpus 4,5,6" in verdict.message  # the log's tail


def test_unwanted_words_in_the_log_fail_the_launch(fake):
    launch = fake("warn")
    assert launch.status == 0 and suite.judge(launch, "alpha").ok
    verdict = suite.judge(launch, suite.LAUNCH)
    assert not verdict.ok and "its log says 'shared CUDA tensors released'" in verdict.message


def test_a_hung_launch_is_killed_with_its_children(fake):
    started = time.monotonic()
    launch = fake("hang", timeout_s=3.0)
    assert launch.status == "timeout" and time.monotonic() - started < 30
    verdict = suite.judge(launch, suite.LAUNCH)
    assert not verdict.ok and "exceeded its time limit" in verdict.message


def _declared_families(script: str) -> tuple:
    """The FAMILIES (or the watchdog's CASES) tuple a check script declares."""
    tree = ast.parse(open(os.path.join(GPU_TESTS, script)).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id in ("FAMILIES", "CASES"):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{script} declares no FAMILIES")


def test_the_models_ask_only_for_families_their_scripts_have():
    asked = {}
    for model in suite.MODELS:
        script = next(os.path.basename(a) for a in model.argv if a.endswith(".py"))
        asked.setdefault(script, set()).update(model.families)
    for script, families in asked.items():
        declared = set(_declared_families(script))
        assert families <= declared, f"{script}: {sorted(families - declared)} not declared"
        assert families == declared, f"{script}: {sorted(declared - families)} never run"
