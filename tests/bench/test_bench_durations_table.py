"""bench/durations_table.py: docs/testing.md's per-file table from pytest's JUnit XML."""

from __future__ import annotations

from pathlib import Path

from bench.durations_table import table

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.engine.test_slow" name="test_a" time="30.4"/>
<testcase classname="tests.engine.test_slow" name="test_b" time="12.2"/>
<testcase classname="tests.core.test_quick.TestGroup" name="test_c" time="0.2"/>
<testcase classname="tests.core.test_quick" name="test_d" time="0.1"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>
"""


def test_each_file_is_a_row_slowest_first_with_its_skipped_tests(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(REPORT)
    assert table(str(report)).splitlines() == [
        "| file | tests | seconds |", "|---|---|---|",
        "| `test_slow.py` | 2 | 43 |",
        "| `test_quick.py` | 2 (1 skipped) | <1 |",
    ]
