"""docs/testing.md's table of how long each test file takes, from a pytest JUnit XML report.

    python -m pytest -q -n 2 -p no:cacheprovider --junitxml=/tmp/junit.xml
    python bench/durations_table.py /tmp/junit.xml

Each row: the file's basename, its tests (and how many skipped), and the sum of its tests' times
(setup, call and teardown, as pytest reports them) in seconds, slowest first.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def table(report: str) -> str:
    """The markdown table of the JUnit XML file ``report``."""
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, int] = defaultdict(int)
    skipped: dict[str, int] = defaultdict(int)
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        module = next((part for part in name if part.startswith("test_")), name[-1])
        file = f"{module}.py"
        seconds[file] += float(case.get("time", 0) or 0)
        tests[file] += 1
        skipped[file] += case.find("skipped") is not None
    rows = ["| file | tests | seconds |", "|---|---|---|"]
    for file in sorted(tests, key=lambda f: (-round(seconds[f]), f)):
        count = f"{tests[file]} ({skipped[file]} skipped)" if skipped[file] else str(tests[file])
        took = f"{seconds[file]:.0f}" if seconds[file] >= 1 else "<1"
        rows.append(f"| `{file}` | {count} | {took} |")
    return "\n".join(rows)


def main() -> None:
    """Print the table of the report named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="pytest's --junitxml file")
    print(table(parser.parse_args().report))


if __name__ == "__main__":
    main()
