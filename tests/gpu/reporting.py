"""What every GPU check script shares: one JSON line per check, and the error measure."""

import json
import threading

import torch


class Reporter:
    """Appends one JSON line per check; safe across threads."""

    def __init__(self, path: str, model: str):
        self.path, self.model, self.lock = path, model, threading.Lock()

    def record(self, name: str, rank: int, ok: bool, detail: str):
        line = json.dumps({"model": self.model, "name": name, "rank": rank, "ok": bool(ok),
                           "detail": detail})
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")
        if not ok:
            print(f"FAIL [{self.model}] {name} rank {rank}: {detail}", flush=True)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")  # NaN poison left somewhere, or an overflow
    return ((out.double() - ref).norm() / ref.norm()).item()
