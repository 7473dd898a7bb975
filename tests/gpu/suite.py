"""The GPU suite's process models: how each is launched and how its checks are judged.

A model is one launch of a check script (torchrun workers, one process driving several GPUs, or
processes the script starts itself) on some of the visible GPUs. Its checks come in families
(the scripts' ``--families``); tests/gpu/test_gpu_suite.py makes a pytest test per (model,
family) plus one for the launch itself, and launches each model once for all its selected tests.
No import of torch or JAX here: the harness is tested on machines without GPUs
(tests/python/test_gpu_suite_harness.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

from reporting import OUTSIDE_FAMILIES

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Never NVLink multicast: it can take a shared host's GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
# The family of a launch's own test: the launcher's exit, and records made outside any family.
LAUNCH = OUTSIDE_FAMILIES

COLLECTIVE_FAMILIES = ("correctness", "fp8", "autograd", "layers", "graphs", "stress", "errors",
                       "lifetime")
JAX_FAMILIES = ("ops", "gradients", "loop", "donation")
WATCHDOG_CASES = ("held", "control", "capture", "dropped", "missing-peer", "peer-late")


@dataclasses.dataclass(frozen=True)
class Model:
    """One launch. ``argv`` may name {python}, {gpus} (how many it is given), {results} and
    {model}; the families asked for (some of ``families``) are appended as ``--families ...``."""

    name: str
    argv: tuple[str, ...]
    families: tuple[str, ...]
    gpus: int | None = None  # the first `gpus` visible GPUs; None: every visible one
    min_gpus: int = 1
    timeout_s: float = 300.0
    env: tuple[tuple[str, str], ...] = ()
    # Words whose appearance in the launch's log fails its launch test (a warning at exit, say).
    log_must_not_contain: tuple[str, ...] = ()

    def gpus_given(self, visible: int) -> int:
        return visible if self.gpus is None else self.gpus

    def runs_on(self, visible: int) -> bool:
        return visible >= max(self.min_gpus, self.gpus or 0)


def _script(name: str) -> str:
    return os.path.join(HERE, name)


def _torchrun(script: str, *args: str, gpus: str = "{gpus}") -> tuple[str, ...]:
    # --standalone: a free rendezvous port, so that two suites may share a host.
    return ("{python}", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            _script(script), "--results", "{results}", "--model", "{model}", *args)


def _python(script: str, *args: str) -> tuple[str, ...]:
    return ("{python}", _script(script), "--results", "{results}", "--model", "{model}", *args)


MODELS = (
    # meshla's GEMM alone, every dtype and fp8's scaled products.
    Model("matmul", _python("check_matmul.py"), ("products", "fp8"), gpus=1),
    Model("grouped", _python("check_grouped.py"),
          ("capture", "passes", "padded", "autograd", "errors", "main-grads", "edges", "compile"),
          gpus=1),
    # The portable grouped GEMM GPUs other than Hopper take for bf16 and fp16 groups (SIMT, fp32
    # sums), forced on Hopper. The compile family is left out: it checks torch.compile's tracing
    # of the ops, which does not depend on the kernel.
    Model("grouped-portable", _python("check_grouped.py"),
          ("capture", "passes", "padded", "autograd", "errors", "main-grads", "edges"), gpus=1,
          env=(("MESHLA_PORTABLE", "1"),)),
    # One process driving 1, 2 and 4 GPUs (as many as there are).
    Model("solver", _python("check_solver.py"), ("jax", "torch", "large", "special"),
          timeout_s=600.0),
    # meshla.jax, one process driving every GPU; command buffers at XLA's default, off, and
    # with the collectives in them.
    Model("jax-collective", _python("check_jax_collective.py"), JAX_FAMILIES),
    Model("jax-collective-no-command-buffers",
          _python("check_jax_collective.py", "--command-buffers", ""), JAX_FAMILIES),
    Model("jax-collective-command-buffer-collectives",
          _python("check_jax_collective.py", "--command-buffers", "+COLLECTIVES"), JAX_FAMILIES),
    # meshla.jax's grouped GEMM on one GPU.
    Model("jax-grouped", _python("check_jax_grouped.py"),
          ("passes", "ragged-layout", "shard-map", "errors"), gpus=1),
    Model("jax-grouped-portable", _python("check_jax_grouped.py"),
          ("passes", "ragged-layout", "shard-map", "errors"), gpus=1,
          env=(("MESHLA_PORTABLE", "1"),)),
    # One process per GPU under jax.distributed (the script starts them).
    Model("jax-collective-processes", _python("check_jax_collective.py", "--processes", "{gpus}"),
          JAX_FAMILIES, min_gpus=2),
    # meshla.jax.linalg on a mesh that spans processes: one process per GPU (the script starts
    # them), every device solving the gathered A, and the solves on cuSOLVERMp. About 7 s a check
    # on 2x H200, most of it XLA compiling each routine for each dtype in both processes.
    Model("solver-jax-processes",
          _python("check_solver_jax_processes.py", "--processes", "{gpus}"), ("routines",),
          min_gpus=2, timeout_s=600.0),
    # The solvers' *_shard forms, one process per GPU (CUDA IPC to the first rank, and
    # cuSOLVERMp); torch warns at a process's exit of tensors it shared through CUDA IPC that were
    # never released.
    *(Model(f"solver-processes-tp{tp}", _torchrun("check_solver_processes.py"),
            ("routines", "special"), gpus=tp,
            log_must_not_contain=("shared CUDA tensors released",)) for tp in (2, 4)),
    # The same where each rank sees only its GPU: every rank solves the gathered A alone.
    Model("solver-processes-own-gpu-tp2", _torchrun("check_solver_processes.py", "--own-gpu"),
          ("routines", "special"), gpus=2),
    # The same over NCCL's network transport, the path between nodes (issue 39: cuSOLVERMp's
    # engine and the gathered solves with no NVLink or shared memory between the ranks).
    Model("solver-processes-network-tp2", _torchrun("check_solver_processes.py", "--own-gpu"),
          ("routines", "special"), gpus=2,
          env=(("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"))),
    # A collective matmul that never finishes ends its process at the timeout.
    Model("watchdog", _python("check_watchdog.py"), WATCHDOG_CASES[:4], gpus=1),
    Model("watchdog-two-gpus", _python("check_watchdog.py"), WATCHDOG_CASES[4:], gpus=2),
    # The collective checks, a process per GPU: a group of one (the ops' local paths), two, four
    # (with two tp=2 groups inside it).
    Model("processes-tp1", _torchrun("check_collective_matmul.py"), COLLECTIVE_FAMILIES, gpus=1),
    Model("processes-tp2", _torchrun("check_collective_matmul.py"), COLLECTIVE_FAMILIES, gpus=2),
    Model("processes-tp4", _torchrun("check_collective_matmul.py"), COLLECTIVE_FAMILIES, gpus=4),
    # cuBLASMp's backend (needs the nvidia-cublasmp-cu13 wheel; a check says so when it is
    # missing).
    Model("cublasmp-tp2", _torchrun("check_collective_matmul.py", "--cublasmp"), ("cublasmp",),
          gpus=2),
    Model("cublasmp-tp4", _torchrun("check_collective_matmul.py", "--cublasmp"), ("cublasmp",),
          gpus=4),
    # One process, a thread per GPU (with 4 GPUs, then two tp=2 groups at once).
    Model("threads", _python("check_collective_matmul.py", "--threads"),
          (*COLLECTIVE_FAMILIES, "cublasmp"), min_gpus=2),
    # NCCL's network transport (the path that crosses nodes) instead of NVLink / shared memory.
    Model("network", _torchrun("check_collective_matmul.py", "--quick"),
          ("correctness", "lifetime"),
          min_gpus=2, env=(("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"))),
    # The paths GPUs other than Hopper take (per-batch cuBLASLt GEMMs for the one-launch gathered
    # GEMM), forced on Hopper.
    Model("portable", _torchrun("check_collective_matmul.py", "--quick"),
          ("correctness", "lifetime"), min_gpus=2, env=(("MESHLA_PORTABLE", "1"),)),
)


@dataclasses.dataclass
class Launch:
    model: Model
    status: int | str  # the exit status, or "timeout"
    seconds: float
    log: str
    results: str

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(collections.deque(f, lines))
        except OSError as error:
            return f"(no log: {error})"


def visible_gpus(count: int) -> list[str]:
    """The ordinals CUDA_VISIBLE_DEVICES names (or 0..count-1): a model's GPUs are the first of
    these, so that a suite confined to some GPUs stays on them."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",")[:count] if listed else [str(i) for i in range(count)]


def launch(model: Model, visible: list[str], families: list[str], log_dir: str, results: str,
           python: str = sys.executable) -> Launch:
    """Runs the model on its GPUs, asking for `families`, and waits for it up to its time limit,
    after which its whole process group is killed."""
    devices = visible[:model.gpus_given(len(visible))]
    fields = {"python": python, "gpus": len(devices), "results": results, "model": model.name}
    argv = [part.format(**fields) for part in model.argv] + ["--families", *families]
    env = {**os.environ, **NO_MULTICAST, **dict(model.env),
           "CUDA_VISIBLE_DEVICES": ",".join(devices), "PYTHONUNBUFFERED": "1",
           # The checks' own limit sits a little under this (they dump their stacks first).
           "MESHLA_LAUNCH_TIMEOUT": str(int(model.timeout_s))}
    log = os.path.join(log_dir, f"{model.name}.log")
    started = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(argv)}\n")
        out.flush()
        process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            status: int | str = process.wait(timeout=model.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun's workers too
            process.wait()
            status = "timeout"
    return Launch(model, status, time.monotonic() - started, log, results)


def read_records(results: str, model: str) -> list[dict]:
    if not os.path.exists(results):
        return []
    with open(results) as f:
        return [r for r in map(json.loads, f) if r["model"] == model]


@dataclasses.dataclass
class Verdict:
    ok: bool
    message: str


def _failures(records: list[dict]) -> tuple[int, list[str]]:
    """(checks, failures): a check passes when every rank of it did."""
    checks = collections.defaultdict(list)
    for r in records:
        checks[r["name"]].append(r)
    failed = []
    for name, ranks in checks.items():
        bad = [r for r in ranks if not r["ok"]]
        if bad:
            failed.append(f"{name} (rank {bad[0]['rank']}): {bad[0]['detail'][:400]}")
    return len(checks), failed


def judge(launch: Launch, family: str) -> Verdict:
    """The verdict on one family of a launch's checks, or (family "launch") on the launch."""
    records = [r for r in read_records(launch.results, launch.model.name)
               if r.get("family", LAUNCH) == family]
    checks, failed = _failures(records)
    where = f"log {launch.log}, {launch.seconds:.0f} s"
    if family == LAUNCH:
        with open(launch.log, errors="replace") as f:
            log = f.read()
        unwanted = [words for words in launch.model.log_must_not_contain if words in log]
        if launch.status != 0 or failed or unwanted:
            reason = ("exceeded its time limit" if launch.status == "timeout"
                      else f"exited with status {launch.status}")
            reason += "".join(f"; its log says {words!r}" for words in unwanted)
            return Verdict(False, "\n".join([f"{launch.model.name} {reason} ({where})", *failed,
                                             "--- log tail ---", launch.log_tail()]))
        return Verdict(True, f"exited 0 ({where})")
    if failed:
        return Verdict(False, "\n".join([f"{len(failed)} of {checks} {family} checks failed "
                                         f"({where}):", *failed[:20]]))
    if checks == 0:
        return Verdict(False, f"no {family} check ran ({where}); log tail:\n{launch.log_tail()}")
    return Verdict(True, f"{checks} {family} checks passed")
