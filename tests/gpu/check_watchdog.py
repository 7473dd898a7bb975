"""GPU check of the execution watchdog: a collective matmul that never finishes ends the process,
with a message naming the op and the timeout, instead of leaving it waiting forever.

  python tests/gpu/check_watchdog.py --results FILE

Each case runs in a child process, on each backend (nccl, symmetric), under a 2 s communicator
timeout; its run must end the process by SIGABRT, with the message, long before it could finish:
  held          (one GPU) the run is held back by a long kernel queued ahead of it on the stream
  missing-peer  (two GPUs, one process, a thread per GPU) both ranks build the plan, then only
                rank 0 runs it: its peer never makes the matching call
and a control (one GPU) whose timeout outlasts a short hold must finish with the right product,
as must a CUDA graph captured in torch's default (global) capture mode while another thread's run
is held back, so that the watchdog queries that run's event throughout the capture: its queries
must not invalidate the capture. A plan dropped while its run is unfinished waits for the run
with the GIL released:
  dropped       (one GPU) the run is held back; another Python thread keeps running throughout
and, where one process drives both ranks, a rank's call waits for its peer's matching call with
the GIL released (meshla's enqueue meeting), then its plan is dropped:
  peer-late     (two GPUs, one process, a thread per GPU) rank 1 makes its call 0.5 s after rank 0,
                which rank 1's thread can do only with the GIL; rank 0's call returns after it
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time

import torch

import meshla.torch as mt
from reporting import Reporter, check_parser, relative_error

# The hold: torch.cuda._sleep cycles, about 10 s and 0.5 s at the H100's and H200's ~2 GHz.
HOLD_CYCLES = {"held": 20_000_000_000, "control": 1_000_000_000, "dropped": 1_000_000_000}
TIMEOUT_S = {"held": 2.0, "control": 120.0, "missing-peer": 2.0, "capture": 120.0,
             "dropped": 120.0, "peer-late": 30.0}
CASES = ("held", "control", "capture", "dropped", "missing-peer", "peer-late")
TWO_GPUS = ("missing-peer", "peer-late")
# Cases whose run must finish (the others must end the process).
FINISHING = ("control", "capture", "dropped", "peer-late")


def operands(device):
    a = torch.randn(256, 512, device=device).to(torch.bfloat16)
    b = torch.randn(512, 384, device=device).to(torch.bfloat16)
    return a, b


def on_both_ranks(work) -> None:
    """Runs work(rank) for ranks 0 and 1, a thread each, and waits for both."""
    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def child_missing_peer(backend: str) -> None:
    groups = mt.local_groups([0, 1], timeout_s=TIMEOUT_S["missing-peer"])
    inputs = [operands(torch.device("cuda", rank)) for rank in range(2)]
    kwargs = dict(algorithm="ring", backend=backend)

    def build(rank):  # the plans are built collectively, by a first call on both ranks
        torch.cuda.set_device(rank)
        mt.all_gather_matmul(inputs[rank][0], inputs[rank][1], groups[rank], **kwargs)
        torch.cuda.synchronize(rank)

    on_both_ranks(build)
    torch.cuda.set_device(0)
    mt.all_gather_matmul(inputs[0][0], inputs[0][1], groups[0], **kwargs)  # rank 1 never calls
    torch.cuda.synchronize(0)
    print("finished", flush=True)


def child_capture(backend: str) -> None:
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    mine, other = (mt.local_groups([0], timeout_s=TIMEOUT_S["capture"])[0] for _ in range(2))
    (a, b), (a2, b2) = operands(device), operands(device)
    kwargs = dict(algorithm="ring", backend=backend)
    out = mt.all_gather_matmul(a, b, mine, **kwargs)  # the plans are built before the capture
    # The other thread allocates nothing while the capture runs (a cudaMalloc would invalidate
    # it), and runs on the symmetric backend, which makes no NCCL call.
    out2 = mt.all_gather_matmul(a2, b2, other, algorithm="ring", backend="symmetric")
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    capturing, held = threading.Event(), threading.Event()

    def hold():
        capturing.wait()
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_CYCLES["control"])
            mt.all_gather_matmul(a2, b2, other, algorithm="ring", backend="symmetric", out=out2)
        held.set()

    thread = threading.Thread(target=hold)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mt.all_gather_matmul(a, b, mine, out=out, **kwargs)
        capturing.set()
        held.wait()
        time.sleep(0.3)  # six polls of the watchdog, each querying the held run's event
    thread.join()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    print(f"finished rel_err={relative_error(out, a.double() @ b.double()):.2e}", flush=True)


def child_dropped(backend: str) -> None:
    torch.cuda.set_device(0)
    group = mt.local_groups([0], timeout_s=TIMEOUT_S["dropped"])[0]
    a, b = operands(torch.device("cuda", 0))
    kwargs = dict(algorithm="ring", backend=backend)
    mt.all_gather_matmul(a, b, group, **kwargs)  # the plan is built before the hold
    torch.cuda.synchronize()
    ticks, stop = [0], threading.Event()

    def tick():  # runs only while no other thread holds the GIL
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device=a.device, dtype=a.dtype)
    torch.cuda._sleep(HOLD_CYCLES["dropped"])
    mt.all_gather_matmul(a, b, group, out=out, **kwargs)
    before, start = ticks[0], time.monotonic()
    group.clear_plans()  # the plan's only reference: destroying it waits for the held run
    drop_ms, during = (time.monotonic() - start) * 1e3, ticks[0] - before
    stop.set()
    ticker.join()
    torch.cuda.synchronize()
    print(f"finished rel_err={relative_error(out, a.double() @ b.double()):.2e} "
          f"drop_ms={drop_ms:.0f} ticks_during_drop={during}", flush=True)


def child_peer_late(backend: str) -> None:
    groups = mt.local_groups([0, 1], timeout_s=TIMEOUT_S["peer-late"])
    inputs = [operands(torch.device("cuda", rank)) for rank in range(2)]
    kwargs = dict(algorithm="ring", backend=backend)
    calling, built = threading.Event(), threading.Barrier(2)
    # Poisoned, so that a run that wrote nothing fails.
    outs = [torch.full((2 * a.shape[0], b.shape[1]), float("nan"), device=a.device, dtype=a.dtype)
            for a, b in inputs]
    times = {}

    def rank(r):
        torch.cuda.set_device(r)
        # Building a plan is collective: both ranks build theirs with a first call.
        mt.all_gather_matmul(*inputs[r], groups[r], **kwargs)
        torch.cuda.synchronize(r)
        built.wait(60)
        if r == 1:
            calling.wait(60)
            time.sleep(0.5)  # rank 0 is waiting in its call by now
            times["peer_enqueue"] = time.monotonic()
        else:
            calling.set()
        mt.all_gather_matmul(*inputs[r], groups[r], out=outs[r], **kwargs)
        if r == 0:
            times["returned"] = time.monotonic()
            groups[0].clear_plans()  # the plan's only reference: it goes here
        torch.cuda.synchronize(r)

    on_both_ranks(rank)
    # Both ranks' products are the whole gathered product: compare each with its reference.
    a = torch.cat([inputs[0][0], inputs[1][0].to(0)])
    errors = [relative_error(outs[r], (a.double() @ inputs[r][1].to(0).double()).to(r))
              for r in range(2)]
    # Rank 0's call returned only after the peer's was made: it waited, and let the peer run.
    waited = times["returned"] - times["peer_enqueue"]
    print(f"finished rel_err={max(errors):.2e} returned_after_peer_call_ms="
          f"{waited * 1e3:.3f}", flush=True)


def child(case: str, backend: str) -> None:
    if case == "missing-peer":
        child_missing_peer(backend)
        return
    if case == "capture":
        child_capture(backend)
        return
    if case == "dropped":
        child_dropped(backend)
        return
    if case == "peer-late":
        child_peer_late(backend)
        return
    torch.cuda.set_device(0)
    group = mt.local_groups([0], timeout_s=TIMEOUT_S[case])[0]
    a, b = operands(torch.device("cuda", 0))
    kwargs = dict(algorithm="ring", backend=backend)
    mt.all_gather_matmul(a, b, group, **kwargs)  # the plan is built before the hold
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES[case])
    out = mt.all_gather_matmul(a, b, group, **kwargs)
    torch.cuda.synchronize()
    print(f"finished rel_err={relative_error(out, a.double() @ b.double()):.2e}", flush=True)


def check(reporter: Reporter, backend: str, case: str) -> None:
    name = f"watchdog/{backend}/{case}"
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", case, "--backend", backend],
                              capture_output=True, text=True, timeout=300)
        waited = re.search(r"enqueued (\d+) ms ago has not finished on the device "
                           r"\(timeout (\d+) ms\)", proc.stderr)
        finished = re.search(r"finished(?: rel_err=(\S+))?", proc.stdout)
        if case not in FINISHING:
            ok = (proc.returncode == -signal.SIGABRT and waited is not None and finished is None
                  and f"all_gather_matmul (backend={backend}) on rank 0 of" in proc.stderr
                  and int(waited.group(1)) >= int(waited.group(2)) == 2000)
        else:
            ok = proc.returncode == 0 and finished is not None and float(finished.group(1)) < 1e-2
        if case == "dropped" and ok:
            # The drop waited for the held run (~0.5 s) while the other thread ran on.
            drop = re.search(r"drop_ms=(\d+) ticks_during_drop=(\d+)", proc.stdout)
            ok = int(drop.group(1)) >= 250 and int(drop.group(2)) >= 50
        if case == "peer-late" and ok:
            late = re.search(r"returned_after_peer_call_ms=(-?[\d.]+)", proc.stdout)
            ok = float(late.group(1)) > 0
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        detail = (f"exit {proc.returncode}; stdout: {proc.stdout.strip()[-200:]!r}; "
                  f"stderr's last line: {last[-400:]!r}")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, 0, ok, detail)


if __name__ == "__main__":
    parser = check_parser(__doc__, "watchdog", CASES, results_required=False)  # a family a case
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.backend)
    else:
        reporter = Reporter(args.results, args.model, args.families)
        cases = [c for c in CASES if c not in TWO_GPUS or torch.cuda.device_count() >= 2]
        for backend in ("nccl", "symmetric"):
            for case in cases:
                reporter.family(case, check, reporter, backend, case)
