"""Generate tests/slow_by_cost.txt from a measured CPU profile of the default suite.

    PRECISIONLAB_TEST_CPU_PROFILE=/tmp/cpu.txt python -m pytest -n 2 -p no:cacheprovider
    python tools/slow_by_cost.py /tmp/cpu.txt --budget 780 [--write]

The profile has one line per test: CPU seconds, wall seconds, node id (tests/conftest.py writes
it). The default suite must stay within ``--budget`` CPU seconds (780 s is about 7 minutes of
wall time on two idle cores: the suite's wall time has been its CPU seconds / 1.85). Tests are
moved to the slow phase most expensive first until the rest fits, except that each test file
keeps its cheapest test in the default suite, so every file still reaches its code by default.
Entries already in the file stay (they were not run, so the profile does not see them); an entry
whose test no longer exists is dropped by tests/project/test_suite_hygiene.py's check, not here.
Without ``--write`` it prints what it would add and the default suite's CPU seconds after.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

LIST = pathlib.Path(__file__).resolve().parent.parent / "tests" / "slow_by_cost.txt"


def read_profile(path: pathlib.Path) -> dict[str, float]:
    """Node id -> CPU seconds (the last line wins for a test listed twice)."""
    costs: dict[str, float] = {}
    for line in path.read_text().splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3:
            costs[parts[2].strip()] = float(parts[0])
    return costs


def choose(costs: dict[str, float], budget: float) -> list[str]:
    """The tests to move, most expensive first, keeping each file's cheapest test."""
    cheapest: dict[str, str] = {}
    for node, cpu in costs.items():
        file = node.split("::", 1)[0]
        if file not in cheapest or cpu < costs[cheapest[file]]:
            cheapest[file] = node
    keep = set(cheapest.values())
    total = sum(costs.values())
    moved = []
    for node in sorted(costs, key=costs.get, reverse=True):
        if total <= budget:
            break
        if node in keep:
            continue
        moved.append(node)
        total -= costs[node]
    return moved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=pathlib.Path)
    parser.add_argument("--budget", type=float, default=780.0, help="CPU seconds (default 780)")
    parser.add_argument("--write", action="store_true", help="append the entries to the list")
    args = parser.parse_args(argv)
    costs = read_profile(args.profile)
    moved = choose(costs, args.budget)
    after = sum(costs.values()) - sum(costs[m] for m in moved)
    print(f"default suite: {sum(costs.values()):.0f} CPU s now, {after:.0f} after moving "
          f"{len(moved)} tests ({sum(costs[m] for m in moved):.0f} CPU s)")  # fmt: skip
    lines = [f"{costs[m]:.1f} {m}" for m in moved]
    if args.write and lines:
        day = datetime.date.today().isoformat()
        with LIST.open("a") as f:
            f.write(f"# added by tools/slow_by_cost.py --budget {args.budget:.0f} from a profile "
                    f"of {day} (2 cores, jax as installed)\n")  # fmt: skip
            f.write("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
