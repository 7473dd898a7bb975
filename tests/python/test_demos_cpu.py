"""The demos of scripts/demo.sh on their CPU paths: every pillar's line says OK."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def run(command, env):
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_demo_runs_every_pillar_on_cpu(framework):
    script = os.path.join(EXAMPLES, f"demo_{framework}.py")
    if framework == "torch":
        out = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", script, "--cpu", "--runs", "2"], {})
    else:
        out = run([sys.executable, script, "--runs", "2"],
                  {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                   "JAX_PLATFORMS": "cpu"})
    lines = [line for line in out.splitlines() if line.startswith(f"[{framework}]")]
    assert lines[-1] == f"[{framework}] demo: OK", out
    checked = [line for line in lines if "vs float64" in line]
    assert len(checked) == 3, out
    assert all(line.endswith(": OK") for line in checked), out
