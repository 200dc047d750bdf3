"""The model card (README.md) of an exported adapter: base model, data, config, held-out answers before
and after, and the loss curve as a picture.

The curve is drawn from the run's events: a PNG through matplotlib when it is installed (it is in
``qlora-studio[trackers]``), else a text chart through plotext inside a code block. :func:`loss_chart` says
which one it made, and the card says so too.

Plain Python (matplotlib and plotext imported only when drawing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs.cells import cell

CHART_FILE = "loss.png"


@dataclass(frozen=True)
class LossCurve:
    """Training loss by step, and validation loss where the run evaluated."""

    train: list[tuple[int, float]]
    validation: list[tuple[int, float]]


def loss_curve(events: list[ev.Event]) -> LossCurve:
    """The curve from a run's events; a resumed run's repeated steps keep their latest value."""
    train = {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}
    validation = {e.step: e.loss for e in events if isinstance(e, ev.EvalLogged)}
    return LossCurve(sorted(train.items()), sorted(validation.items()))


def loss_chart(curve: LossCurve, folder: Path) -> tuple[str, str]:
    """Draw the curve for the card: (``"png"``, markdown image) with matplotlib, else (``"text"``,
    a fenced plotext chart); (``"none"``, a sentence) when nothing was logged."""
    if not curve.train:
        return "none", "_No training steps were logged, so there is no loss curve._"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a GPU box over SSH
        import matplotlib.pyplot as plt
    except ImportError:
        return "text", _text_chart(curve)
    figure, axes = plt.subplots(figsize=(6, 3.2), dpi=100)
    axes.plot(*zip(*curve.train, strict=True), label="training loss", linewidth=1.2)
    if curve.validation:
        axes.plot(*zip(*curve.validation, strict=True), "o-", label="validation loss", linewidth=1.2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(folder / CHART_FILE)
    plt.close(figure)
    return "png", f"![loss curve]({CHART_FILE})"


def _text_chart(curve: LossCurve) -> str:
    import plotext as plt

    plt.clear_figure()
    plt.plotsize(72, 18)
    plt.theme("clear")
    plt.plot(*zip(*curve.train, strict=True), label="training loss", marker="braille")
    if curve.validation:
        plt.plot(*zip(*curve.validation, strict=True), label="validation loss", marker="o")
    plt.xlabel("optimizer step")
    chart = plt.build()
    plt.clear_figure()
    return "```text\n" + chart + "\n```\n(drawn as text: install matplotlib for a picture)"


def _cell(text: Any, width: int = 40) -> str:
    """A markdown table cell: :func:`~studio.core.runs.cells.cell`, with its pipes escaped."""
    return cell(text, width).replace("|", "\\|")


def held_out_table(report: dict[str, Any], rows: int = 10) -> str:
    """The before/after table from ``studio eval``'s report (eval.json) as markdown."""
    lines = ["| target | base model | fine-tuned |", "|---|---|---|"]
    for row in report.get("results", [])[:rows]:
        base = ("✓ " if row.get("base_exact") else "") + _cell(row.get("base", ""))
        tuned = ("✓ " if row.get("tuned_exact") else "") + _cell(row.get("tuned", ""))
        lines.append(f"| {_cell(row.get('target', ''))} | {base} | {tuned} |")
    b, t = report.get("base", {}), report.get("fine_tuned", {})
    lines.append("")
    lines.append(f"On {report.get('rows', 0)} {report.get('split', 'held-out')} rows, exact match went from "
                 f"{b.get('exact_match', 0):.1%} to {t.get('exact_match', 0):.1%} and similarity from "
                 f"{b.get('similarity', 0):.2f} to {t.get('similarity', 0):.2f} (greedy answers).")
    return "\n".join(lines)


def model_card(config: RunConfig, run_id: str, base_ref: str, events: list[ev.Event], folder: Path,
               eval_report: dict[str, Any] | None, template: str) -> tuple[str, str]:
    """The README.md text for an adapter exported to ``folder`` (the chart is written there too);
    returns (card, chart kind: png, text or none)."""
    started = next((e for e in events if isinstance(e, ev.RunStarted)), None)
    finished = [e for e in events if isinstance(e, ev.TrainingFinished)]
    kind, chart = loss_chart(loss_curve(events), folder)
    lora, trainer = config.lora, config.trainer
    targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
    on_hub = re.fullmatch(r"[\w.-]+/[\w.-]+", base_ref) is not None and not Path(base_ref).exists()
    # The Hub checks that base_model names a model there, so a local folder stays out of the metadata.
    front = {**({"base_model": base_ref} if on_hub else {}), "library_name": "peft", "tags": ["lora", "studio"]}
    parts = [
        "---", *(f"{k}: {json.dumps(v)}" for k, v in front.items()), "---", "",
        f"# {config.name or run_id}", "",
        f"A LoRA adapter for [{base_ref}](https://huggingface.co/{base_ref}), fine-tuned with Studio "
        f"(run `{run_id}`)." if on_hub else
        f"A LoRA adapter for the model in `{base_ref}`, fine-tuned with Studio (run `{run_id}`).", "",
        "## Use", "", "```python", "from peft import AutoPeftModelForCausalLM",
        "model = AutoPeftModelForCausalLM.from_pretrained(\"PATH_OR_REPO_OF_THIS_FOLDER\")", "```", "",
        "Prompts must be written with the template it was trained on (`prompt_template.txt` here; the "
        f"answer starts where `{{{config.prompt.response_field}}}` stands).", "",
        "## Data", "",
        f"- dataset: `{config.data.path}`",
    ]
    if started is not None:
        parts.append(f"- {started.train_rows} training rows, {started.eval_rows} validation rows")
    parts += [
        "", "## Training", "",
        f"- LoRA r={lora.r}, alpha={lora.alpha}, dropout={lora.dropout}, target modules: {targets}",
        f"- quantization: {f'{config.quantization.bits}-bit' if config.quantization.bits else 'none'}",
        f"- learning rate {trainer.learning_rate}, effective batch {trainer.effective_batch_size}, "
        f"max sequence length {config.data.max_seq_length}",
    ]
    if finished:
        last = finished[-1]
        best = f", best validation loss {last.best_eval_loss:.4f}" if last.best_eval_loss is not None else ""
        parts.append(f"- {last.step} optimizer steps, final training loss {last.train_loss:.4f}{best}")
    parts += ["", "### Loss", "", chart, ""]
    parts += ["## Held-out answers, before and after", ""]
    if eval_report:
        parts.append(held_out_table(eval_report))
    else:
        parts.append(f"_Not measured yet: run `studio eval {run_id}` and export again._")
    parts += ["", "## Prompt template", "", "```text", template, "```", ""]
    return "\n".join(parts), kind
