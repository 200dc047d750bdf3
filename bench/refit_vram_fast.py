"""Search the fast path's fitted constants (core/memory/fast.py) on a measured file's in-sample rows.

The measured file is bench/vram_measure.py's (tests/data/vram_measured.json by default); rows are
scored with its ``score``, the estimate ``studio estimate`` gives of each row's config. The search
fits only the fast-path rows not marked out of sample; the out-of-sample rows are scored after it,
never fitted. Without --search, the rows scored with the constants as they stand.

    python3 bench/refit_vram_fast.py [tests/data/vram_measured.json] [--search]

A constant it finds goes into core/memory/fast.py by hand, with the file it was fitted on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vram_measure import PINNED, print_score, score  # noqa: E402
from studio.core.memory import fast  # noqa: E402

GRID = {"LAYER_WORKING_SET": [x / 20 for x in range(16, 33)],
        "GRAPH_POOL_PER_TOKEN": [x / 8 for x in range(0, 13)]}
"""The values tried for each of core/memory/fast.py's fitted constants."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=str(PINNED))
    parser.add_argument("--search", action="store_true", help="grid-search the constants on in-sample fast rows")
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    print_score(score(results))
    if not args.search:
        return 0
    fitted = {**results, "rows": [r for r in results["rows"]
                                  if not r["out_of_sample"] and r["measured"].get("path") == "fast"]}
    best = None
    for values in itertools.product(*GRID.values()):
        for name, value in zip(GRID, values, strict=True):
            setattr(fast, name, value)
        errors = [abs(e) for r in score(fitted)["rows"] for e in r["error"].values()]
        key = (statistics.fmean(errors), max(errors))  # the mean: one odd row must not steer it
        if best is None or key < best[0]:
            best = (key, dict(zip(GRID, values, strict=True)))
    print(f"best on {len(fitted['rows'])} in-sample fast rows (mean, worst abs error; constants): {best}")
    for name, value in best[1].items():
        setattr(fast, name, value)
    print_score(score(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
