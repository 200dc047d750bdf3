"""``studio embed``: one vector per row from the fine-tuned (or base) model's hidden states, to Parquet.

Each row is rendered the way the model saw prompts in training: through the run's template, up to
where the response starts (a file with only a ``text`` column is embedded as that text). The vector is
one of the text decoder's hidden states, numbered as transformers numbers them for every family: ``0``
the token embeddings as the first layer receives them (Gemma scales them by the square root of the
width, Granite by its embedding multiplier), ``N`` the output of layer N, except that the last (``-1``,
the same as the layer count) is the final norm's output. A multimodal checkpoint (Gemma 3 4B+) gives
its text tower's. The state is pooled over the row's tokens (``mean``) or taken at its last token
(``last``, what the model answers from). Rows go through in padded batches; the Parquet file keeps
every input column and adds ``embedding`` (a list of float32).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from studio.core import events as ev
from studio.core.runs import RunDir

POOLS = ("mean", "last")


class EmbedError(ValueError):
    """The embedding job cannot run as asked; the message says what to do."""


def row_texts(rows: list[dict[str, Any]], template: str, response_field: str) -> list[str]:
    """The prompt text of each row (the template up to the response), or its ``text`` column."""
    from studio.core.prompt import render, template_fields

    fields = [f for f in template_fields(template) if f != response_field]
    columns = set(rows[0]) if rows else set()
    if columns & set(fields):
        return [render(template, {**row, response_field: ""}, response_field).prompt for row in rows]
    if "text" in columns:
        return [str(row["text"] or "") for row in rows]
    raise EmbedError(f"the rows have columns {', '.join(sorted(columns)) or '(none)'} but the run's template needs "
                     f"{', '.join(fields)}; give rows with those columns, or a 'text' column")


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Pool ``hidden`` (batch, tokens, dim) over the tokens ``mask`` keeps: their mean, or the last one."""
    mask = mask.to(hidden.dtype)
    if how == "mean":
        return (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    last = mask.sum(1).long() - 1  # right padding: the last real token of each row
    return hidden[torch.arange(hidden.shape[0]), last.clamp(min=0)]


def embed_texts(model: Any, tokenizer: Any, texts: list[str], layer: int = -1, how: str = "mean",
                batch_size: int = 16, device: torch.device | str = "cpu",
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Embeddings of ``texts`` (rows, dim), float32 on the CPU."""
    import inspect

    from studio.engine.generate import prompt_ids

    if how not in POOLS:
        raise EmbedError(f"--pool {how} is not one of {', '.join(POOLS)}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Logits are not needed: one position's instead of every token's (rows x tokens x a vocabulary
    # of up to 262k, gigabytes at a batch of 16) where the model's forward takes logits_to_keep.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(inner.forward).parameters else {}
    out: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(texts), batch_size):
            ids = [prompt_ids(tokenizer, t) or [pad] for t in texts[start:start + batch_size]]
            width = max(len(i) for i in ids)
            input_ids = torch.tensor([i + [pad] * (width - len(i)) for i in ids], device=device)
            mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids], device=device)
            with torch.no_grad():
                hidden = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                               use_cache=False, **keep).hidden_states
            if not -len(hidden) <= layer < len(hidden):
                raise EmbedError(f"--layer {layer}: this model has layers 0..{len(hidden) - 1} (or -1 for the last)")
            out.append(pool(hidden[layer].float(), mask, how).cpu())
            if progress is not None:
                progress(min(start + batch_size, len(texts)), len(texts))
    finally:
        if was_training:
            model.train()
    return torch.cat(out) if out else torch.empty(0, 0)


def write_parquet(rows: list[dict[str, Any]], vectors: torch.Tensor, path: Path) -> None:
    """The input rows with an ``embedding`` column, written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows) if rows and rows[0] else pa.table({})
    if "embedding" in table.column_names:
        table = table.drop(["embedding"])
    column = pa.array(vectors.numpy().tolist(), type=pa.list_(pa.float32()))
    table = table.append_column("embedding", column) if table.num_columns else pa.table({"embedding": column})
    tmp = path.with_name(path.name + ".partial")
    pq.write_table(table, tmp)
    shutil.move(tmp, path)


def embed_run(run: RunDir, command: ev.Embed, emit: Callable[[ev.Event], object]) -> ev.ExportFinished:
    """Serve an Embed command: load the model (with the run's adapter unless ``base``), embed, write."""
    from studio.core.data import load_table
    from studio.engine.export import find_adapter
    from studio.engine.exporting import run_template
    from studio.engine.merge import check_causal_lm
    from studio.engine.model import load_adapter, load_base
    from studio.engine.pull import resolve_model

    out = Path(command.out)
    started = time.monotonic()

    def progress(stage: str, fraction: float) -> None:
        emit(ev.ExportProgress(path=str(out), stage=stage, fraction=round(fraction, 4)))

    try:
        config = run.config()
        progress("reading the rows", 0.0)
        rows = [dict(r) for r in load_table(command.data)]
        if not rows:
            raise EmbedError(f"{command.data}: no rows to embed")
        adapter = None if command.base else find_adapter(run)
        check_causal_lm(resolve_model(config.model.base_model, progress=lambda msg: progress(msg, 0.02)),
                        config.model.revision, config.model.trust_remote_code)
        base = load_base(config, progress=lambda stage, f: progress(stage, 0.02 + f * 0.1))
        model = load_adapter(base, adapter) if adapter is not None else base.model
        texts = row_texts(rows, run_template(config, base.tokenizer), config.prompt.response_field)
        vectors = embed_texts(model, base.tokenizer, texts, command.layer, command.pool, max(1, command.batch_size),
                              base.device, lambda done, total: progress(f"embedding rows {done}/{total}",
                                                                         0.15 + 0.8 * done / total))
        progress("writing Parquet", 0.97)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_parquet(rows, vectors, out)
        progress("done", 1.0)
        who = "base" if command.base else "fine-tuned"
        finished = ev.ExportFinished(path=str(out), ok=True, seconds=time.monotonic() - started, message=(
            f"{len(rows)} rows x {vectors.shape[1]} dims from layer {command.layer} ({command.pool} pooling, "
            f"{who} model)"))
    except Exception as exc:  # every failure becomes a message; the worker stays up
        text = str(exc).strip().splitlines()
        known = isinstance(exc, (EmbedError, FileNotFoundError)) or type(exc).__name__ in ("DataError", "ExportError")
        message = text[0] if known and text else f"embedding failed: {type(exc).__name__}: {text[0] if text else ''}"
        finished = ev.ExportFinished(path=str(out), ok=False, message=message)
    emit(finished)
    return finished
