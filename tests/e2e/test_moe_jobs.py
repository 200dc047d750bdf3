"""Every job after training, for a mixture of experts, as a person runs them: a tiny Qwen3-MoE, Mixtral
and OLMoE (tests/helpers/tiny_families.py, bfloat16 as the Hub's) trained by a detached worker with its
expert weights packed in 4 bits (bitsandbytes' CPU backend, ``quantization.on_cpu: keep``) and LoRA on
the attention and the experts (``lora.target_experts``) on the fast path; then, on that worker, chat
with and without the adapter, ``studio eval``, ``studio embed``, ``studio export --format merged``
(bfloat16 and float32) and ``--format gguf``.

The references are computed here, apart from the worker: PEFT's ``PeftModel`` over the same 4-bit
load for the answers and embeddings, and over the unquantized base (float32) for the exports, which
merge into the full-precision weights (docs/export.md); the GGUF is read back as llama.cpp reads it
(tests/helpers/gguf_reading.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("gguf")

from helpers.gguf_reading import load_as_llama_cpp  # noqa: E402
from helpers.tiny_families import build  # noqa: E402
from helpers.worker import wait_for  # noqa: E402

from studio.cli import main as studio_main  # noqa: E402
from studio.core import events as ev  # noqa: E402
from studio.core.config import RunConfig  # noqa: E402
from studio.core.prompt import render  # noqa: E402
from studio.core.runs import RunDir, create_run  # noqa: E402
from studio.engine.tiny import TINY_TEMPLATE, reverse_word_rows  # noqa: E402
from studio.worker.client import WorkerClient, start_worker  # noqa: E402

ROW = {"instruction": "Reverse the letters of the word.", "input": "s-t-o-n-e"}
STEPS = 30
NEW_TOKENS = 12


@dataclass
class Trained:
    """A family's run, trained by the worker that is still up for it, and its events so far."""

    name: str
    run: RunDir
    client: WorkerClient
    events: list[ev.Event]
    work: Path


def _config(base: Path, data: Path, runs: Path) -> RunConfig:
    config = RunConfig()
    config.model.base_model = str(base)
    config.quantization.bits, config.quantization.on_cpu = 4, "keep"
    config.lora.r, config.lora.alpha, config.lora.dropout = 8, 16, 0.0
    config.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config.lora.target_experts = True
    config.prompt.template = TINY_TEMPLATE
    config.data.path = str(data)
    config.data.max_seq_length = 64
    t = config.trainer
    t.learning_rate, t.max_steps, t.micro_batch_size, t.effective_batch_size = 5e-3, STEPS, 8, 8
    t.eval_interval, t.eval_max_rows, t.checkpoint_interval, t.log_interval = 0, 8, 0, 5
    t.gradient_checkpointing, t.packing = False, False
    config.generation.max_new_tokens, config.generation.temperature = NEW_TOKENS, 0.0
    config.output_dir = str(runs)
    return config


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "olmoe"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """``studio train --detach``'s worker trains the family's run to the end and stays up for the jobs
    after it (each test's commands reach it as `studio` reaches a run's worker)."""
    name = request.param
    work = tmp_path_factory.mktemp(f"moe-{name}")
    data = work / "reverse.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in reverse_word_rows(400, seed=0)))
    base = build(name, work / "base", dtype="bfloat16")
    run = create_run(_config(base, data, work / "runs"))
    with pytest.MonkeyPatch.context() as patch:
        # Inherited by the worker: the CPU (conftest.on_cpu says why), the fast path there (the GPU's
        # default), a device lock of its own, and a worker that waits for the next job.
        for key, value in {"STUDIO_DEVICE": "cpu", "STUDIO_FAST_PATH": "1", "STUDIO_LOCK_DIR": str(work / "locks"),
                           "STUDIO_WORKER_LINGER": "600"}.items():
            patch.setenv(key, value)
        start_worker(run, train=True)
        client = WorkerClient(run)
        events: list[ev.Event] = []
        try:
            client.connect(timeout=30)
            wait_for(client, lambda e: isinstance(e, (ev.TrainingFinished, ev.WorkerFailed)), timeout=300,
                     seen=events)
            yield Trained(name, run, client, events, work)
        finally:
            client.close()
            if (pid := run.worker_pid()) is not None:
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 60
                while run.worker_pid() is not None and time.monotonic() < deadline:
                    time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(trained: Trained) -> Any:
    """The run's adapter with PEFT over the base as Studio loads it for the run (4 bits, experts packed)."""
    from peft import PeftModel

    from studio.engine.model import load_base

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STUDIO_DEVICE", "cpu")
        base = load_base(trained.run.config())
    return PeftModel.from_pretrained(base.model, str(trained.run.adapter_dir)).eval(), base.tokenizer


def _greedy(model: Any, tokenizer: Any, row: dict) -> str:
    """transformers' own greedy generation for the row's prompt, decoded as Studio's chat decodes it
    (unstripped: a first token that decodes to whitespace stays; `studio eval` strips its answers)."""
    text = render(TINY_TEMPLATE, {**row, "output": ""}, "output").prompt
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _studio(*args: str) -> tuple[int, str]:
    """``studio ARGS`` in this process (it connects to the run's worker); its exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = studio_main(list(args))
    return code, out.getvalue()


def test_the_worker_trains_with_packed_experts_on_the_fast_path(trained: Trained) -> None:
    loaded = next(e for e in trained.events if isinstance(e, ev.ModelLoaded))
    assert (loaded.path, loaded.quantization) == ("fast", "nf4"), loaded
    finished = next(e for e in trained.events if isinstance(e, (ev.TrainingFinished, ev.WorkerFailed)))
    assert isinstance(finished, ev.TrainingFinished) and finished.step == STEPS, finished
    steps = [e for e in trained.events if isinstance(e, ev.StepLogged)]
    assert steps[-1].loss < steps[0].loss
    saved = json.loads((trained.run.adapter_dir / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def test_chat_after_training_answers_with_the_trained_adapter(trained: Trained, reference) -> None:
    """The worker's answers with the adapter and without it (the base through the packed experts)
    are transformers' greedy answers with PEFT's adapter, and training moved them."""
    model, tokenizer = reference
    for adapter in (True, False):
        trained.client.send(ev.Generate(request_id=f"chat-{adapter}", row=ROW, adapter=adapter))
    answers: dict[bool, str] = {}
    while len(answers) < 2:
        done = wait_for(trained.client, lambda e: isinstance(e, ev.GenerationFinished), timeout=120)
        answers[done.adapter] = done.text
    assert answers[True] != answers[False]
    assert answers[True] == _greedy(model, tokenizer, ROW)
    with model.disable_adapter():
        assert answers[False] == _greedy(model, tokenizer, ROW)


def test_studio_eval_scores_the_fine_tune_above_the_base(trained: Trained, reference) -> None:
    """`studio eval RUN`: its fine-tuned answers are PEFT's, and closer to the targets than the base's."""
    code, out = _studio("eval", str(trained.run.path), "--json", "--rows", "6")
    assert code == 0
    report = json.loads(out)
    assert report["rows"] == 6 and json.loads((trained.run.path / "eval.json").read_text())["rows"] == 6
    print(f"{trained.name}: similarity base {report['base']['similarity']:.2f} -> "
          f"fine-tuned {report['fine_tuned']['similarity']:.2f}")
    assert report["fine_tuned"]["similarity"] > report["base"]["similarity"]
    model, tokenizer = reference
    rows = reverse_word_rows(400, seed=0)
    by_prompt = {render(TINY_TEMPLATE, {**r, "output": ""}, "output").prompt: r for r in rows}
    for result in report["results"][:3]:
        assert result["tuned"] == _greedy(model, tokenizer, by_prompt[result["prompt"]]).strip()


def test_studio_embed_gives_the_adapters_hidden_states(trained: Trained, reference) -> None:
    import pyarrow.parquet as pq

    from studio.engine.embed import embed_texts

    rows = [{"text": t} for t in ("s-t-o-n-e", "a longer row of several words", "x")]
    data = trained.work / "embed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    vectors = {}
    for who in ("tuned", "base"):
        out = trained.work / f"{who}.parquet"
        code, _ = _studio("embed", str(trained.run.path), "--data", str(data), "--out", str(out), "--pool", "last",
                          *(["--base"] if who == "base" else []))
        assert code == 0
        vectors[who] = torch.tensor(pq.read_table(out).column("embedding").to_pylist())
    model, tokenizer = reference
    texts = [r["text"] for r in rows]
    with torch.no_grad():
        torch.testing.assert_close(vectors["tuned"], embed_texts(model, tokenizer, texts, how="last"),
                                   rtol=1e-4, atol=1e-4)
        with model.disable_adapter():
            torch.testing.assert_close(vectors["base"], embed_texts(model, tokenizer, texts, how="last"),
                                       rtol=1e-4, atol=1e-4)
    assert vectors["tuned"].shape == (3, 64) and (vectors["tuned"] - vectors["base"]).abs().max() > 1e-2


def _unquantized_peft(trained: Trained) -> Any:
    """The run's adapter over the base loaded unquantized in float32: what the merge must equal."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(trained.run.config().model.base_model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(trained.run.adapter_dir)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(4, 300, (8, 32), generator=torch.Generator().manual_seed(0))


def test_studio_export_merged_loads_in_transformers_and_answers_like_the_adapter(trained: Trained) -> None:
    """float32: PEFT's logits to 1e-4. bfloat16 (the default): each weight the float32 merge's rounded
    once, and the next-token choices PEFT's where rounding moves no router's choice or near-tie."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    peft_model = _unquantized_peft(trained)
    with torch.no_grad():
        expected = peft_model(input_ids=_ids()).logits
    got = {}
    for dtype in ("float32", "bfloat16"):
        out = trained.work / f"merged-{dtype}"
        code, printed = _studio("export", str(trained.run.path), "--format", "merged", "--dtype", dtype,
                                "--out", str(out))
        assert code == 0 and printed.strip() == str(out)
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(merged) is type(peft_model.get_base_model())
        with torch.no_grad():
            got[dtype] = merged(input_ids=_ids()).logits
    torch.testing.assert_close(got["float32"], expected, rtol=1e-4, atol=1e-4)
    full, rounded = (load_file(trained.work / f"merged-{d}" / "model.safetensors") for d in ("float32", "bfloat16"))
    assert full.keys() == rounded.keys() and any(".experts." in k for k in full)
    for key, tensor in rounded.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[key].to(torch.bfloat16)), key
    agree = (got["bfloat16"].argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"{trained.name} bf16 merge: {agree:.1%} of next-token choices agree with PEFT's")
    assert agree >= 0.95


def test_studio_export_gguf_predicts_like_the_merge(trained: Trained) -> None:
    """`studio export --format gguf`: the f16 file, read as llama.cpp reads it, makes the float32 merge's
    next-token choices; no LoRA GGUF (llama.cpp's adapters have no form for expert weights), said."""
    out = trained.work / "gguf"
    code, printed = _studio("export", str(trained.run.path), "--format", "gguf", "--out", str(out))
    assert code == 0 and printed.strip() == str(out)
    finished = [e for e in trained.run.events() if isinstance(e, ev.ExportFinished) and e.path == str(out)][-1]
    assert "no LoRA GGUF" in finished.message and not (out / "adapter-lora-f32.gguf").exists()
    peft_model = _unquantized_peft(trained)
    with torch.no_grad():
        expected = peft_model(input_ids=_ids()).logits.argmax(-1)
        got = load_as_llama_cpp(out, "model-f16.gguf")(_ids()).logits.argmax(-1)
    agree = (got == expected).float().mean().item()
    print(f"{trained.name} GGUF f16: {agree:.1%} of next-token choices agree with the merge")
    assert agree >= 0.99
