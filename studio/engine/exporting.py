"""``studio export RUN --format adapter|merged|gguf``: what the worker runs for an ExportRun command.

- ``adapter``: the PEFT folder with ``base_model_name_or_path`` set to the hub id the run used (not
  the local cache path the engine loaded it from), a model card (README.md, with the loss curve) and
  the prompt template beside it.
- ``merged``: the adapter merged into the base (loaded unquantized in ``dtype``; see
  :mod:`studio.engine.merge`), saved as safetensors with the tokenizer, generation config and a
  multimodal base's image processor files; ``AutoModelForCausalLM.from_pretrained`` loads it as the
  base's own class.
- ``gguf``: the merged model (merged in float32, then stored as ``quant``; gpt-oss' MXFP4 experts
  that the adapter left alone as shipped) as one GGUF file, the
  adapter alone as a llama.cpp LoRA GGUF, and an Ollama Modelfile with the run's template. An adapter
  llama.cpp has no LoRA form for (expert weights, DoRA, rsLoRA, trained whole modules) gets no LoRA
  GGUF; the message says why, and the model GGUF has it merged.

A full fine-tune (``lora: null``) has no adapter: ``merged`` saves its weights (nothing to merge),
``gguf`` converts them (no LoRA GGUF), and ``adapter`` is refused in one line.

Each writes into ``<path>.partial`` and renames it when complete, reports ExportProgress events and
ends with one ExportFinished; nothing raises out of :func:`export_run`.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from studio.core import events as ev
from studio.core.runs import RunDir, is_full_model
from studio.engine.export import DTYPES, ExportError, find_adapter
from studio.engine.gguf_export import (
    QUANTS,
    GgufExportError,
    check_architecture,
    check_quant,
    lora_gguf_refusal,
    write_gguf,
    write_lora_gguf,
)

FORMATS = ("adapter", "merged", "gguf")
TEMPLATE_FILE = "prompt_template.txt"
Emit = Callable[[ev.Event], object]


def hub_id(ref: str) -> str:
    """The hub id behind a model reference: Studio's cache folder ``owner--name`` and the hub cache's
    ``models--owner--name/snapshots/<rev>`` map back to ``owner/name``; anything else is kept."""
    from studio.core.paths import cache_dir

    path = Path(ref).expanduser()
    if not path.exists():
        return ref
    resolved = path.resolve()
    for part in reversed(resolved.parts):
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    if resolved.parent == cache_dir().resolve() and "--" in resolved.name:
        return resolved.name.replace("--", "/", 1)
    return ref


def _base_path(run: RunDir, say: Callable[[str], None]) -> str:
    from studio.engine.pull import resolve_model

    return resolve_model(run.config().model.base_model, progress=say)


def _base_folder(run: RunDir) -> Path:
    """The folder holding the base model's config.json and weights (a hub id's snapshot in the cache)."""
    from transformers.utils import cached_file

    found = cached_file(_base_path(run, lambda _m: None), "config.json", revision=run.config().model.revision)
    return Path(found).parent


def _base_config(run: RunDir) -> dict[str, Any]:
    """The base model's config.json, as a dict."""
    return json.loads((_base_folder(run) / "config.json").read_text())


def run_template(config: Any, tokenizer: Any) -> str:
    """The literal template the run trained with (presets and ``chat`` resolved as the trainer does)."""
    from studio.core.prompt import resolve_template

    return resolve_template(config.prompt, getattr(tokenizer, "chat_template", None),
                            bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")


def export_adapter_folder(run: RunDir, dest: Path, progress: Callable[[str, float], None]) -> str:
    """Write the adapter folder (:func:`~studio.core.runs.copy_adapter`'s PEFT files) with its model card,
    template and config; returns a note on how the loss chart was drawn."""
    from transformers import AutoTokenizer

    from studio.core.export.model_card import model_card
    from studio.core.runs import copy_adapter

    config = run.config()
    find_adapter(run)  # none yet: ExportError, the message every export gives
    progress("copying the adapter", 0.1)
    copy_adapter(run, dest)  # the PEFT files only (no optimizer or RNG state of a checkpoint)
    base_ref = hub_id(config.model.base_model)
    peft_config = json.loads((dest / "adapter_config.json").read_text())
    peft_config["base_model_name_or_path"] = base_ref
    (dest / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
    progress("writing the model card", 0.5)
    tokenizer = AutoTokenizer.from_pretrained(_base_path(run, lambda _m: None), revision=config.model.revision)
    template = run_template(config, tokenizer)
    (dest / TEMPLATE_FILE).write_text(template, encoding="utf-8")
    config.save(dest / "studio_config.yaml")
    eval_path = run.path / "eval.json"
    report = json.loads(eval_path.read_text()) if eval_path.exists() else None
    card, chart = model_card(config, run.id, base_ref, run.events(), dest, report, template)
    (dest / "README.md").write_text(card, encoding="utf-8")
    return {"png": "loss curve drawn with matplotlib (loss.png)", "text": "loss curve drawn as text (plotext); "
            "install matplotlib for a picture", "none": "no loss curve (no steps logged)"}[chart]


def merge(run: RunDir, dtype: str, progress: Callable[[str, float], None]) -> tuple[Any, Any]:
    """The run's model in ``dtype``: its base unquantized with the adapter merged in
    (:mod:`studio.engine.merge`), or a full fine-tune's weights; and the tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from studio.engine.merge import load_unquantized, merge_adapter

    config = run.config()
    adapter = find_adapter(run)
    progress("loading the base model", 0.05)
    base = _base_path(run, lambda msg: progress(msg, 0.05))
    # A full fine-tune's weights are the model already: nothing to merge (the tokenizer is the
    # base's, which a checkpoint's model/ folder does not carry).
    full = is_full_model(adapter)
    model = load_unquantized(str(adapter) if full else base, getattr(torch, dtype),
                             None if full else config.model.revision, config.model.trust_remote_code)
    if not full:
        progress("merging the adapter into the weights", 0.3)
        model = merge_adapter(model, adapter)
    tokenizer = AutoTokenizer.from_pretrained(base, revision=config.model.revision)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    generation = model.generation_config
    generation.eos_token_id = generation.eos_token_id if generation.eos_token_id is not None else \
        tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def export_merged_folder(run: RunDir, dest: Path, dtype: str, progress: Callable[[str, float], None]) -> None:
    """Save the merged model, tokenizer, generation config, image processor files (a multimodal base)
    and prompt template into ``dest``."""
    from studio.engine.merge import copy_processor_files

    model, tokenizer = merge(run, dtype, progress)
    progress("saving safetensors", 0.5)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    copy_processor_files(_base_path(run, lambda _m: None), dest, run.config().model.revision)
    (dest / TEMPLATE_FILE).write_text(run_template(run.config(), tokenizer), encoding="utf-8")


def export_gguf(run: RunDir, dest: Path, quant: str, progress: Callable[[str, float], None]) -> str:
    """The merged model as GGUF, the LoRA-only GGUF adapter and an Ollama Modelfile in ``dest``;
    returns the names of the GGUF files written (and why there is no LoRA GGUF, where there is none
    for an adapter)."""
    from studio.core.export.modelfile import modelfile
    from studio.core.prompt.tokens import load_tokenizer_info
    from studio.engine.merge import check_causal_lm

    if quant not in QUANTS:
        raise GgufExportError(f"--quant {quant} is not one of {', '.join(QUANTS)}")
    config = run.config()
    # What cannot be merged (an encoder-decoder) or llama.cpp does not run (another architecture, a
    # config it would misread) is refused before minutes of merging, not after.
    check_causal_lm(_base_path(run, lambda _m: None), config.model.revision, config.model.trust_remote_code)
    check_quant(quant, check_architecture(_base_config(run)))
    staging = dest / "merged-f32"
    # float32 merge: the GGUF's own rounding (f16, q8_0) is then the only one.
    export_merged_folder(run, staging, "float32", lambda stage, f: progress(stage, f * 0.45))
    base_config = json.loads((staging / "config.json").read_text())
    model_file = f"model-{quant}.gguf"
    # the base's MXFP4 experts (gpt-oss) are written as shipped where the merge left them
    write_gguf(staging, dest / model_file, quant, lambda stage, f: progress(stage, 0.45 + f * 0.45),
               name=config.name or run.id, shipped=_base_folder(run))
    adapter = find_adapter(run)
    lora_file, refusal = None, None
    if not is_full_model(adapter):  # a full fine-tune has no adapter to write alone
        refusal = lora_gguf_refusal(json.loads((adapter / "adapter_config.json").read_text()))
    if not is_full_model(adapter) and refusal is None:
        progress("writing the LoRA GGUF adapter", 0.92)
        lora_file = "adapter-lora-f32.gguf"
        write_lora_gguf(adapter, base_config, dest / lora_file)
    template = (staging / TEMPLATE_FILE).read_text(encoding="utf-8")
    shutil.move(staging / TEMPLATE_FILE, dest / TEMPLATE_FILE)
    tokenizer = load_tokenizer_info(staging)
    (dest / "Modelfile").write_text(modelfile(model_file, template, config.prompt.response_field, tokenizer.eos_token,
                                              temperature=config.generation.temperature,
                                              adapter_name=lora_file, base_gguf_hint=hub_id(config.model.base_model),
                                              chat_template=tokenizer.chat_template,
                                              # conversation rows train only with template: chat
                                              use_chat=config.prompt.template == "chat"))
    shutil.rmtree(staging)
    if refusal:
        return f"{model_file} (no LoRA GGUF: {refusal})"
    return f"{model_file}, {lora_file}" if lora_file else model_file


def export_run(run: RunDir, path: str | Path, format: str = "adapter", quant: str = "f16",
               dtype: str = "bfloat16", emit: Emit | None = None) -> ev.ExportFinished:
    """Export ``run`` to the folder ``path``; never raises (the ExportFinished says what happened)."""
    send = emit or (lambda _event: None)
    dest = Path(path)
    tmp = dest.with_name(dest.name + ".partial")
    started = time.monotonic()

    def progress(stage: str, fraction: float) -> None:
        send(ev.ExportProgress(path=str(dest), stage=stage, fraction=round(min(max(fraction, 0.0), 1.0), 4)))

    try:
        if format not in FORMATS:
            raise ExportError(f"--format {format} is not one of {', '.join(FORMATS)}")
        if format == "merged" and dtype not in DTYPES:
            raise ExportError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
        if dest.exists():
            raise ExportError(f"{dest} already exists; choose a new folder or remove it")
        if is_full_model(find_adapter(run)) and format == "adapter":  # no adapter: say so before loading
            raise ExportError(f"run {run.id} is a full fine-tune (lora: null): it has no adapter; export it "
                              "with --format merged (its weights) or --format gguf")
        shutil.rmtree(tmp, ignore_errors=True)
        note = ""
        if format == "adapter":
            note = export_adapter_folder(run, tmp, progress)
        elif format == "merged":
            export_merged_folder(run, tmp, dtype, progress)
            note = f"merged {dtype} model"
        else:
            tmp.mkdir(parents=True)
            made = export_gguf(run, tmp, quant, progress)
            # The command names the folder as it is after the rename below, not the staging one.
            note = f"{made} and a Modelfile ('ollama create NAME -f {dest / 'Modelfile'}')"
        tmp.rename(dest)
        progress("done", 1.0)
        finished = ev.ExportFinished(path=str(dest), ok=True, message=note, seconds=time.monotonic() - started)
    except (ExportError, GgufExportError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        finished = ev.ExportFinished(path=str(dest), ok=False, message=str(exc))
    except Exception as exc:  # every failure becomes a message; the worker stays up
        traceback.print_exc()  # to the worker's stderr, which is the run's log the message points to
        shutil.rmtree(tmp, ignore_errors=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        finished = ev.ExportFinished(path=str(dest), ok=False, message=(
            f"exporting run {run.id} as {format} failed: {type(exc).__name__}: {first}; see {run.log_path}"))
    send(finished)
    return finished
