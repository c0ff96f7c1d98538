"""Where a test run's time went: seconds per tier and per module, and the slowest tests.

``python tests/report.py REPORT.xml [REPORT.xml ...] [--slowest N]`` reads the JUnit XML reports that
``make test`` writes (pytest's ``--junitxml``; each test's time there is its setup, call and teardown
together, so a shared engine's start counts against the first test that uses it) and prints three
tables: the tiers (``tests/<tier>/``), the modules, and the ``N`` slowest tests (default 25).
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _cases(path: Path) -> list[tuple[str, str, float, str]]:
    """(module path, test name, seconds, outcome) of every test case in the JUnit report at ``path``."""
    out = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        out.append((module, case.get("name", ""), float(case.get("time", "0")), outcome))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the tables for the reports named in ``argv``; 0, or 2 when a report cannot be read."""
    p = argparse.ArgumentParser(prog="python tests/report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="JUnit XML reports (pytest --junitxml)")
    p.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list (default 25)")
    args = p.parse_args(argv)
    cases = []
    for path in args.reports:
        try:
            cases += _cases(path)
        except (OSError, ET.ParseError) as exc:
            p.error(f"reports: cannot read {path}: {exc}")
    tiers: dict[str, list[float]] = collections.defaultdict(list)
    modules: dict[str, list[float]] = collections.defaultdict(list)
    for module, _, seconds, _ in cases:
        parts = module.split("/")
        tiers[parts[1] if len(parts) > 2 else parts[0]].append(seconds)
        modules[module].append(seconds)
    total = sum(s for _, _, s, _ in cases)
    print(f"\n{len(cases)} tests, {total:.0f} s of test time (setup, call and teardown summed over the reports)")
    print(f"\n{'tier':<14}{'tests':>7}{'seconds':>10}{'share':>8}")
    for tier, times in sorted(tiers.items(), key=lambda kv: -sum(kv[1])):
        print(f"{tier:<14}{len(times):>7}{sum(times):>10.0f}{sum(times) / max(total, 1e-9):>8.0%}")
    print(f"\n{'module':<58}{'tests':>7}{'seconds':>10}")
    for module, times in sorted(modules.items(), key=lambda kv: -sum(kv[1]))[:30]:
        print(f"{module:<58}{len(times):>7}{sum(times):>10.0f}")
    print(f"\nthe {args.slowest} slowest tests (seconds, setup + call + teardown):")
    for module, name, seconds, outcome in sorted(cases, key=lambda c: -c[2])[: args.slowest]:
        mark = "" if outcome == "passed" else f"  [{outcome}]"
        print(f"{seconds:>8.1f}  {module}::{name}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
