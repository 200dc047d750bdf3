"""Re-score a measured Trainer grid with the estimator as it stands, and search the fast path's fitted
constants (core/vram_fast.py) on the in-sample rows only; the out-of-sample rows are scored, never fitted.

    python3 bench/refit_vram_fast.py bench/results/h100_vram_trainer_v3.json [--search]

Short rows are sized from the token lengths the run recorded (``longest_examples``): the tokenizer
the GPU run gave the random models, not the local one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vram_accuracy import ARCHS, Case, predicted_peaks  # noqa: E402
from studio.core import vram_fast  # noqa: E402
from studio.core.vram import estimate_plan  # noqa: E402

CONSTANTS = ("_GRAPH_POOL_PER_TOKEN", "_OFFLOAD_PER_TOKEN", "_LAYER_WORKING_SET")


def _infos(rows: list[dict]) -> dict:
    from transformers import LlamaConfig

    from studio.core.model_info import load_model_info

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for arch in {r["case"]["arch"] for r in rows}:
            where = Path(folder) / arch
            LlamaConfig(**ARCHS[arch], bos_token_id=1, eos_token_id=2).save_pretrained(where)
            out[arch] = load_model_info(str(where))
    return out


def score(rows: list[dict], infos: dict) -> list[tuple[dict, float, float]]:
    """(row, allocated error, reserved error) of each row, predicted now."""
    out = []
    for row in rows:
        case = Case(**{**row["case"], "targets": tuple(row["case"]["targets"])})
        plan = case.plan()
        if case.data == "short" and row["measured"].get("longest_examples"):
            plan = replace(plan, lengths=tuple(row["measured"]["longest_examples"]))
        peaks = predicted_peaks(estimate_plan(infos[case.arch], plan), case.phases(row["measured"]))
        m = row["measured"]
        out.append((row, (peaks["peak_allocated"] - m["peak_allocated"]) / m["peak_allocated"],
                    (peaks["peak_reserved"] - m["peak_reserved"]) / m["peak_reserved"]))
    return out


def summary(scored) -> str:
    parts = []
    for name, pick in (("all", lambda r: True), ("in sample", lambda r: r["in_sample"]),
                       ("out of sample", lambda r: not r["in_sample"])):
        chosen = [(a, b) for r, a, b in scored if pick(r)]
        if chosen:
            alloc = [abs(a) for a, _ in chosen]
            res = [abs(b) for _, b in chosen]
            parts.append(f"{name} (n={len(chosen)}): allocated median {statistics.median(alloc):.1%} worst "
                         f"{max(alloc):.1%}, reserved median {statistics.median(res):.1%} worst {max(res):.1%}")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--search", action="store_true", help="grid-search the constants on in-sample rows")
    args = parser.parse_args()
    rows = [r for r in json.loads(Path(args.results).read_text())["rows"] if "peak_reserved" in r.get("measured", {})]
    infos = _infos(rows)
    scored = score(rows, infos)
    for row, a, b in scored:
        print(f"{'   ' if row['in_sample'] else 'OOS'} {row['label'][:80]:80} allocated {a:+6.1%} reserved {b:+6.1%}")
    print(summary(scored))
    if args.search:
        fast = [r for r in rows if r["in_sample"] and r.get("path") == "fast"]
        best = None
        grid = {"_GRAPH_POOL_PER_TOKEN": [x / 4 for x in range(0, 9)],
                "_OFFLOAD_PER_TOKEN": [0, 1, 2, 3, 4],
                "_LAYER_WORKING_SET": [0.85, 0.9, 0.95, 1.0]}
        for values in itertools.product(*grid.values()):
            for name, value in zip(grid, values, strict=True):
                setattr(vram_fast, name, value)
            errors = [abs(b) for _, _, b in score(fast, infos)] + [abs(a) for _, a, _ in score(fast, infos)]
            key = (statistics.fmean(errors), max(errors))  # the mean: one odd row must not steer it
            if best is None or key < best[0]:
                best = (key, dict(zip(grid, values, strict=True)))
        print("best on the in-sample fast rows (mean, worst abs error; constants):", best)
        for name, value in best[1].items():
            setattr(vram_fast, name, value)
        print(summary(score(rows, infos)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
