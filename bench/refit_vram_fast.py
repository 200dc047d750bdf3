"""Search the fast path's fitted constants (core/vram_fast.py) on measured Trainer grids' in-sample
rows only, scoring with bench/rescore_vram.py's ``rescore`` (the out-of-sample rows are scored, never
fitted); without --search, the rows scored with the constants as they stand. Several results files:
each one's rows and summary, then the summary over all of them (the search fits all their in-sample
fast rows).

    python3 bench/refit_vram_fast.py bench/results/current/h100_vram_trainer_v5_a.json \
        bench/results/current/h100_vram_trainer_v5_b.json [--search]

The current engine's grid is v5 (engine of 09fac3a); the v3 and v4 files still score, with the
constants fitted to the engine they measured.
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

from bench.rescore_vram import rescore  # noqa: E402
from studio.core import vram_fast  # noqa: E402

GRID = {"_GRAPH_POOL_PER_TOKEN": [x / 4 for x in range(0, 9)],
        "_OFFLOAD_PER_TOKEN": [0, 1, 2, 3, 4],
        "_LAYER_WORKING_SET": [x / 20 for x in range(18, 29)]}
"""The current engine's constants (core/vram_fast.py); rows measured on the engine before 09fac3a are
scored with the constants fitted to that one (``vram_fast.UNFUSED``), which the search leaves alone:
fit on the grid of the engine that runs now (bench/results/current/h100_vram_trainer_v5_*.json); the v3 and
v4 grids are its history."""


def scored_rows(results: dict) -> list[dict]:
    """The measured rows of ``results``, re-scored with the estimator as it stands."""
    return [r for r in rescore(results)["rows"] if "error_peak_reserved" in r]


def summary(rows: list[dict]) -> str:
    parts = []
    for name, pick in (("all", lambda r: True), ("in sample", lambda r: r["in_sample"]),
                       ("out of sample", lambda r: not r["in_sample"])):
        chosen = [r for r in rows if pick(r)]
        if chosen:
            alloc = [abs(r["error_peak_allocated"]) for r in chosen]
            res = [abs(r["error_peak_reserved"]) for r in chosen]
            parts.append(f"{name} (n={len(chosen)}): allocated median {statistics.median(alloc):.1%} worst "
                         f"{max(alloc):.1%}, reserved median {statistics.median(res):.1%} worst {max(res):.1%}")
    return "\n".join(parts)


def write_scored(path: str, results: dict[str, dict], rows: list[dict]) -> None:
    """One JSON of the rows as the estimator scores them now, with each source file's command,
    GPU and versions: ``summary.peak_reserved.median_abs_error`` and the rest over every row, and
    ``summary.out_of_sample`` over the rows never tuned on."""
    from bench.vram_accuracy import summarize

    first = next(iter(results.values()))
    out = {"what": "issue 18's grid re-scored with the estimator as committed (bench/refit_vram_fast.py --write)",
           "command": "python3 bench/refit_vram_fast.py " + " ".join(sys.argv[1:]),
           "sources": {name: {k: one.get(k) for k in ("command", "code", "gpu", "versions")}
                       for name, one in results.items()},
           "gpu": first.get("gpu"), "versions": first.get("versions"),
           "summary": {**summarize(rows), "out_of_sample": summarize([r for r in rows if not r["in_sample"]]),
                       "rows": len(rows), "out_of_sample_rows": sum(not r["in_sample"] for r in rows)},
           "rows": rows}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--search", action="store_true", help="grid-search the constants on in-sample rows")
    parser.add_argument("--write", default="", help="also write the files' rows, re-scored, as one JSON "
                                                     "(bench/vram_accuracy.py's summary keys, out of sample apart)")
    args = parser.parse_args()
    results = {name: json.loads(Path(name).read_text()) for name in args.results}

    def every_row() -> list[dict]:
        return [row for one in results.values() for row in scored_rows(one)]

    for name, one in results.items():
        if len(results) > 1:
            print(f"== {name}")
        rows = scored_rows(one)
        for row in rows:
            print(f"{'   ' if row['in_sample'] else 'OOS'} {row['label'][:80]:80} allocated "
                  f"{row['error_peak_allocated']:+6.1%} reserved {row['error_peak_reserved']:+6.1%}")
        print(summary(rows))
    if len(results) > 1:
        print("== every file above")
        print(summary(every_row()))
    if args.write:
        write_scored(args.write, results, every_row())
    if args.search:
        fitted = [{"rows": [r for r in one["rows"] if r.get("in_sample") and r.get("path") == "fast"]}
                  for one in results.values()]
        best = None
        for values in itertools.product(*GRID.values()):
            for name, value in zip(GRID, values, strict=True):
                setattr(vram_fast, name, value)
            errors = [abs(r[k]) for one in fitted for r in scored_rows(one)
                      for k in ("error_peak_allocated", "error_peak_reserved")]
            key = (statistics.fmean(errors), max(errors))  # the mean: one odd row must not steer it
            if best is None or key < best[0]:
                best = (key, dict(zip(GRID, values, strict=True)))
        print("best on the in-sample fast rows (mean, worst abs error; constants):", best)
        for name, value in best[1].items():
            setattr(vram_fast, name, value)
        print(summary(every_row()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
