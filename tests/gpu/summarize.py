"""Folds the per-rank JSON lines of the GPU suite into one verdict per check.

A check passes when every rank of it passed. Prints the failures, then "N passed, N failed".
"""

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    checks: dict = defaultdict(list)
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            checks[(entry["model"], entry["name"])].append(entry)
    failed = {key: entries for key, entries in checks.items() if not all(e["ok"] for e in entries)}
    for (model, name), entries in sorted(failed.items()):
        bad = [e for e in entries if not e["ok"]]
        print(f"FAILED {model} {name}: rank {bad[0]['rank']}: {bad[0]['detail'][:300]}")
    passed = len(checks) - len(failed)
    print(f"{passed} passed, {len(failed)} failed")
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
