"""Re-score a bench/vram_accuracy.py result file with the current estimator (CPU only, no GPU needed).

bench/vram_accuracy.py stores, per grid row, the case and what the GPU measured. This script rebuilds
each case's Plan and ModelInfo exactly as that benchmark does (``Case.plan()`` and the architecture's
config) and calls the same ``estimate_plan``. The estimator models today's engine only: a file
measured on an older engine (its ``code`` or command says which) scores as history, and the HF loop's
rows (transformers' own loss) as if Studio's Trainer computed the loss. The estimator's accuracy on
today's engine is bench/vram_measure.py's file, which tests/core/test_vram_measured.py checks.

    PYTHONPATH=. python bench/rescore_vram.py --results bench/results/current/vram_accuracy_h100_v3.json \\
        --out /tmp/rescored.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vram_accuracy import ARCHS, Case, _rel, predicted_peaks, summarize  # noqa: E402
from studio.core.memory import estimate_plan  # noqa: E402
from studio.core.model.info import from_config_dict  # noqa: E402

GB = 1e9


def rescore(results: dict) -> dict:
    """Rows of ``results`` with fresh predictions and errors; rows without a measurement are kept
    as they are (they were skipped or failed on the GPU)."""
    rows = []
    for old in results["rows"]:
        case = Case(**{**old["case"], "targets": tuple(old["case"]["targets"])})
        if case.engine == "unsloth" or case.lever:  # not Studio's defaults: nothing to predict
            continue
        # the benchmark reads the saved model's config.json; the architecture dict is what it saved
        info = from_config_dict(dict(ARCHS[case.arch]), case.arch)
        measured = old.get("measured")
        plan = case.plan()
        if case.data == "short" and (measured or {}).get("longest_examples"):
            # the lengths the run trained on (the GPU's tokenizer), not this machine's encoding
            plan = replace(plan, lengths=tuple(measured["longest_examples"]))
        predicted = estimate_plan(info, plan)
        # the peak over the phases of a run the row measured (the HF loop: training steps only)
        peaks = predicted_peaks(predicted, case.phases(measured or {}))
        row = {"label": case.label, "case": old["case"], "path": predicted.plan.path,
               "predicted": {**peaks, "categories": predicted.step_categories,
                             "peak_phase": predicted.peak_phase}}
        if predicted.plan.data_sized:
            row["predicted"]["micro_batch_tokens"] = predicted.plan.real_tokens
        if measured is None or "peak_allocated" not in measured:
            row["measured"] = measured
            rows.append(row)
            continue
        # Trainer rows: the peak over every phase of the run (training steps, evaluation, save, generation)
        row["measured"] = {k: measured[k] for k in ("peak_allocated", "peak_reserved", "categories", "path",
                                                    "train_peak_allocated", "train_peak_reserved",
                                                    "generate_peak_allocated", "generate_peak_reserved")
                           if k in measured}
        for key in ("in_sample", "out_of_sample"):
            if key in old:
                row[key] = old[key]
        for key in ("peak_allocated", "peak_reserved"):
            row["error_" + key] = _rel(peaks[key], measured[key])
        rows.append(row)
    return {"source": results.get("command"), "gpu": results.get("gpu"), "versions": results.get("versions"),
            "summary": summarize(rows), "rows": rows}


def _print(rescored: dict) -> None:
    print(f"{'row':<66} {'alloc pred/meas GB':>19} {'err':>7} {'reserved pred/meas GB':>22} {'err':>7}")
    for row in rescored["rows"]:
        if "error_peak_allocated" not in row:
            print(f"{row['label']:<66} (no measurement)")
            continue
        p, m = row["predicted"], row["measured"]
        print(f"{row['label']:<66} {p['peak_allocated'] / GB:8.3f} /{m['peak_allocated'] / GB:8.3f} "
              f"{row['error_peak_allocated']:+7.1%} {p['peak_reserved'] / GB:11.3f} /{m['peak_reserved'] / GB:8.3f} "
              f"{row['error_peak_reserved']:+7.1%}")
    for key, s in rescored["summary"].items():
        print(f"{key}: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} "
              f"over {s['n']} rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="a JSON written by bench/vram_accuracy.py")
    parser.add_argument("--out", default=None, help="also write the re-scored rows and summary here")
    args = parser.parse_args(argv)
    path = Path(args.results)
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{path}: cannot read it as JSON ({exc})", file=sys.stderr)
        return 1
    rescored = rescore(results)
    _print(rescored)
    if args.out:
        rescored["command"] = "PYTHONPATH=. python " + " ".join(["bench/rescore_vram.py", *(argv or sys.argv[1:])])
        Path(args.out).write_text(json.dumps(rescored, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
