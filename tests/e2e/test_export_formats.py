"""``studio export``'s three formats on a briefly fine-tuned tiny model: the adapter folder with its card,
merged safetensors that answer like Studio, and GGUF files that a real GGUF reader (transformers'
loader, which CI has; tests/engine/test_export_llamacpp.py runs llama.cpp itself) loads to the same answers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.cli import run_studio

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from studio.core import events as ev  # noqa: E402
from studio.core.runs import RunDir, create_run  # noqa: E402
from studio.engine import generate as gen  # noqa: E402
from studio.engine.exporting import export_run, hub_id  # noqa: E402
from studio.worker.eventlog import EventLog  # noqa: E402

HELD_OUT = 10


@pytest.fixture(scope="module")
def trained(make_tiny_config, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, list[dict], list[list[int]]]:
    """A run trained in-process for 40 steps (its events logged), 10 held-out rows, and Studio's own
    greedy answers (token ids) to them with the adapter."""
    from studio.core.data import load_splits
    from studio.engine.session import Session

    config = make_tiny_config(tmp_path_factory.mktemp("export"))
    config.trainer.max_steps = 40
    config.trainer.eval_interval = 20
    config.generation.temperature = 0.0
    run = create_run(config)
    # Trained and answered on the CPU on every machine (conftest.on_cpu says why): the exports are
    # reloaded in float32 on the CPU and must give these same answers.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STUDIO_DEVICE", "cpu")
        log = EventLog(run.events_path)
        session = Session(config, run, log.append)
        session.train()
        log.close()
        rows = list(load_splits(config).test)[:HELD_OUT]
        answers = [list(session.generate(row, adapter=True).token_ids) for row in rows]
    return run, rows, answers


def _prompt_ids(tokenizer, run: RunDir, row: dict) -> list[int]:
    from studio.core.prompt import render
    from studio.engine.exporting import run_template

    config = run.config()
    text = render(run_template(config, tokenizer), {**row, "output": ""}, "output").prompt
    return gen.prompt_ids(tokenizer, text)


def _greedy(model, tokenizer, run: RunDir, rows: list[dict]) -> list[list[int]]:
    max_new = run.config().generation.max_new_tokens
    return [list(gen.generate(model, tokenizer, _prompt_ids(tokenizer, run, row), max_new_tokens=max_new,
                              temperature=0.0, device="cpu").token_ids) for row in rows]


def test_adapter_export_names_the_base_and_carries_a_card(trained, tmp_path: Path) -> None:
    run, _, _ = trained
    events: list[ev.Event] = []
    result = export_run(run, tmp_path / "adapter", "adapter", emit=events.append)
    assert result.ok, result.message
    folder = tmp_path / "adapter"
    peft_config = json.loads((folder / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == hub_id(run.config().model.base_model)
    card = (folder / "README.md").read_text()
    # The tiny base is a local folder: named in the text, kept out of the Hub's base_model metadata.
    assert "base_model:" not in card and f"`{run.config().model.base_model}`" in card
    assert "r=16" in card and "reverse.jsonl" in card and "| target | base model | fine-tuned |" not in card
    assert (folder / "loss.png").read_bytes()[:4] == b"\x89PNG" and "![loss curve](loss.png)" in card
    assert (folder / "prompt_template.txt").read_text() == run.config().prompt.template
    assert [e.fraction for e in events if isinstance(e, ev.ExportProgress)][-1] == 1.0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # Loadable by peft from the exported folder alone (the tiny base is a local folder, so its path stays).
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(peft_config["base_model_name_or_path"]),
                                      str(folder))
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_hub_id_maps_cache_folders_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from studio.core.paths import cache_dir

    cached = cache_dir() / "HuggingFaceTB--SmolLM2-135M-Instruct"
    snapshot = tmp_path / "hub" / "models--owner--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id(str(snapshot)) == "owner/some-model"
    if cached.exists():
        assert hub_id(str(cached)) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id(str(tmp_path)) == str(tmp_path)


def test_merged_export_reloads_and_answers_like_studio(trained, tmp_path: Path) -> None:
    """float32: every answer equals Studio's. bfloat16 rounds each merged weight to 8 bits of mantissa;
    the count of changed answers is printed (see docs/export.md for what it was)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, rows, studio_answers = trained
    result = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert result.ok, result.message
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json", "prompt_template.txt"):
        assert (tmp_path / "merged" / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert _greedy(model, tokenizer, run, rows) == studio_answers

    assert export_run(run, tmp_path / "bf16", "merged", dtype="bfloat16").ok
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    differ = sum(a != b for a, b in zip(_greedy(bf16, tokenizer, run, rows), studio_answers, strict=True))
    print(f"bf16 merged: {differ}/{len(rows)} greedy answers differ from Studio's")
    assert differ <= len(rows) // 2


def test_gguf_export_loads_in_a_gguf_reader_with_the_same_answers(trained, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, rows, studio_answers = trained
    answers: dict[str, list[list[int]]] = {}
    for quant in ("f16", "q8_0"):
        out = tmp_path / f"gguf-{quant}"
        events: list[ev.Event] = []
        result = export_run(run, out, "gguf", quant=quant, emit=events.append)
        assert result.ok, result.message
        stages = {e.stage for e in events if isinstance(e, ev.ExportProgress)}
        assert f"converting to {quant}" in stages and "merging the adapter into the weights" in stages
        model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=f"model-{quant}.gguf", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(out), gguf_file=f"model-{quant}.gguf")
        # The GGUF's own tokenizer metadata encodes prompts exactly as the run's tokenizer does.
        assert [_prompt_ids(tokenizer, run, row) for row in rows[:3]] == \
            [_prompt_ids(AutoTokenizer.from_pretrained(run.config().model.base_model), run, row) for row in rows[:3]]
        answers[quant] = _greedy(model, tokenizer, run, rows)
    assert answers["f16"] == studio_answers
    differ = sum(a != b for a, b in zip(answers["q8_0"], studio_answers, strict=True))
    print(f"q8_0 GGUF: {differ}/{len(rows)} greedy answers differ from Studio's")
    assert differ <= 2, "q8_0 tolerance: at most 2 of 10 greedy answers may change"

    modelfile = (tmp_path / "gguf-f16" / "Modelfile").read_text()
    assert "FROM ./model-f16.gguf" in modelfile and "{{ .Prompt }}" in modelfile
    assert 'PARAMETER stop "<|eos|>"' in modelfile and 'PARAMETER stop "### Instruction:"' in modelfile
    assert "ADAPTER ./adapter-lora-f32.gguf" in modelfile


def test_lora_gguf_holds_the_adapter_delta_in_gguf_layout(trained, tmp_path: Path) -> None:
    """llama.cpp applies W + alpha/r * B @ A per tensor; rebuilt from the LoRA GGUF, that must equal the
    merged GGUF's weights (f32) minus the base's, both in GGUF's layout."""
    import gguf

    from studio.engine.gguf_export import write_gguf

    run, _, _ = trained
    assert export_run(run, tmp_path / "g", "gguf", quant="f32").ok
    write_gguf(run.config().model.base_model, tmp_path / "base.gguf", "f32")
    merged = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "g" / "model-f32.gguf").tensors}
    base = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "base.gguf").tensors}
    lora = gguf.GGUFReader(tmp_path / "g" / "adapter-lora-f32.gguf")
    alpha = float(lora.fields["adapter.lora.alpha"].parts[-1][0])
    parts = {t.name: t.data for t in lora.tensors}
    names = sorted(n.removesuffix(".lora_a") for n in parts if n.endswith(".lora_a"))
    assert "blk.0.attn_q.weight" in names and "blk.1.ffn_down.weight" in names
    for name in names:
        a, b = parts[name + ".lora_a"], parts[name + ".lora_b"]
        delta = alpha / a.shape[0] * (b @ a)
        assert abs(delta).max() > 0
        assert abs(base[name] + delta - merged[name]).max() < 1e-4, name


def test_unknown_architecture_and_bad_quant_are_clear(trained, tmp_path: Path) -> None:
    from studio.engine.gguf_export import GgufExportError, check_architecture

    with pytest.raises(GgufExportError, match="covers Llama, Mistral, Qwen2.*this model is 'gpt2'.*--format merged"):
        check_architecture({"model_type": "gpt2"})
    run, _, _ = trained
    result = export_run(run, tmp_path / "x", "gguf", quant="q3_k")
    assert not result.ok and "q3_k is not one of" in result.message and not (tmp_path / "x").exists()


def test_studio_export_runs_through_the_worker(trained, tmp_path: Path, studio_env: dict) -> None:
    """The CLI sends ExportRun to the run's worker (started for it) and prints the folder it wrote."""

    run, _, _ = trained
    env = {**studio_env, "STUDIO_LOCK_DIR": str(tmp_path / "locks"), "STUDIO_WORKER_LINGER": "3"}
    out = tmp_path / "cli-gguf"
    done = run_studio("export", str(run.path), "--format", "gguf", "--quant", "q8_0", "--out", str(out), env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert (out / "model-q8_0.gguf").exists() and (out / "Modelfile").exists()
    logged = [e for e in run.events() if isinstance(e, ev.ExportFinished) and e.path == str(out)]
    assert logged and logged[-1].ok

    again = run_studio("export", str(run.path), "--out", str(out), env=env, timeout=300)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines()[-1] == f"error: {out} already exists; choose a new folder or remove it"


def test_a_run_without_an_adapter_is_a_clear_message(tmp_path: Path) -> None:
    from studio.core.config import RunConfig

    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    result = export_run(run, tmp_path / "out", "gguf")
    assert not result.ok and "no saved adapter yet" in result.message and "train or stop the run" in result.message
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_unknown_quant_is_refused_before_any_worker_starts(tmp_path: Path, capsys) -> None:
    from studio.cli import main as studio_main
    from studio.core.config import RunConfig

    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    assert studio_main(["export", str(run.path), "--format", "gguf", "--quant", "q4_k_m"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --quant q4_k_m is not one of f32, f16") and "llama-quantize" in err
    assert run.worker_pid() is None


FAKE_OLLAMA = '''import sys
from pathlib import Path

# As `ollama create NAME -f FILE` does: read FILE, and every FROM / ADAPTER path in it must exist
# (a relative one is read from FILE's folder).
create, name, flag, modelfile = sys.argv[1:5]
assert (create, flag) == ("create", "-f"), sys.argv
modelfile = Path(modelfile)
if not modelfile.is_file():
    sys.exit(f"Error: open {modelfile}: no such file or directory")
for line in modelfile.read_text().splitlines():
    word, _, ref = line.partition(" ")
    if word in ("FROM", "ADAPTER") and not (modelfile.parent / ref).is_file():
        sys.exit(f"Error: {word} {ref}: no such file")
print(f"success: {name}")
'''


def test_the_printed_ollama_command_runs(trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    """`studio export RUN --format gguf` ends with an `ollama create NAME -f PATH` to type: run as printed
    (against a stand-in for ollama that checks the files as ollama would), it finds the Modelfile and
    the GGUF it names."""
    import shlex
    import subprocess
    import sys

    from studio.cli import main as studio_main

    run, _, _ = trained
    monkeypatch.setenv("STUDIO_DEVICE", "cpu")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ollama").write_text(f"#!{sys.executable}\n{FAKE_OLLAMA}")
    (bin_dir / "ollama").chmod(0o755)
    try:
        assert studio_main(["export", str(run.path), "--format", "gguf", "--quant", "q8_0"]) == 0
    finally:
        studio_main(["stop", str(run.path)])  # the worker the export started
    err = capsys.readouterr().err
    printed = [line.split("'")[1] for line in err.splitlines() if "'ollama create" in line]
    assert len(printed) == 1, err
    command = printed[0].replace("NAME", "tiny-reverse")
    done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout + done.stderr
