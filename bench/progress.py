"""Progress of a long benchmark: a line as each of its cases starts, "[name i/N] what, at Ts"
(what runs, how far along, and since when the benchmark runs)."""

import time


class Progress:
    def __init__(self, name: str, total: int, enabled: bool = True):
        self.name, self.total, self.enabled = name, total, enabled
        self.count, self.started = 0, time.perf_counter()

    def start(self, what: str) -> None:
        self.count += 1
        if self.enabled:
            print(f"[{self.name} {self.count}/{self.total}] {what}, at "
                  f"{time.perf_counter() - self.started:.0f} s", flush=True)
