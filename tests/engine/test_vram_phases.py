"""Every phase of a run, measured and estimated: training step, evaluation, generation, save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_bench_trainer_row_runs_a_generation_phase_through_the_session(tiny_model: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """bench/vram_measure.py's rows (bench/engines.py run_trainer) answer one held-out prompt as long
    as a training row through Session.generate after training, exactly the fixed number of new
    tokens, and report it beside the training's numbers, with the run config they trained with:
    the one whose estimate tests/core/test_vram_measured.py checks (its answer as long as the phase's)."""
    import yaml

    import studio.engine.generate as gen
    from bench.engines import GENERATE_NEW_TOKENS, run_trainer
    from bench.vram_measure import ALL, Row
    from studio.core.config import parse_config

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    calls = []
    real = gen.generate

    def spy(model, tokenizer, input_ids, **kwargs):
        calls.append((len(input_ids), kwargs["max_new_tokens"]))
        return real(model, tokenizer, input_ids, **kwargs)

    monkeypatch.setattr(gen, "generate", spy)
    row = run_trainer(Row("tiny", "bf16", 8, ALL, 64, 2), tiny_model, steps=2, warmup=1, work=tmp_path)
    assert row["steps"] == 2 and len(row["losses"]) == 2
    # one answer between the two steps (the moment the estimate models), one after training
    assert calls == [(row["generate_prompt_tokens"], GENERATE_NEW_TOKENS)] * 2
    assert row["between_steps_generate_new_tokens"] == GENERATE_NEW_TOKENS
    assert row["generate_new_tokens"] == GENERATE_NEW_TOKENS  # EOS does not cut the phase short
    assert 48 <= row["generate_prompt_tokens"] <= 64  # about one training row's length
    assert gen.stop_ids is not None and gen.stop_ids.__name__ == "stop_ids"  # the bench's patch is undone
    config = parse_config(yaml.safe_dump(row["config"]))
    assert (config.lora.r, config.data.max_seq_length, config.trainer.micro_batch_size) == (8, 64, 2)
    assert config.generation.max_new_tokens == GENERATE_NEW_TOKENS


def test_generation_computes_the_prompts_last_logits_only(tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    """The prompt's pass of engine/generate.py asks for the last position's logits only (a prompt of
    4096 tokens over a 128k vocabulary would otherwise hold 1 GB of bf16 logits, more than a
    fast-path training step), and the greedy answer is the one the full logits give."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import studio.engine.generate as gen

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    widths = []
    model.get_base_model().register_forward_hook(lambda module, args, out: widths.append(out.logits.shape[1]))
    prompt = gen.prompt_ids(tokenizer, "reverse the words of this fairly long sentence please " * 3)
    assert len(prompt) > 20
    lean = gen.generate(model, tokenizer, prompt, max_new_tokens=5, device="cpu")
    assert widths[0] == 1 and set(widths) == {1}
    widths.clear()
    monkeypatch.setattr(gen, "_last_logits_only", lambda model: {})
    full = gen.generate(model, tokenizer, prompt, max_new_tokens=5, device="cpu")
    assert widths[0] == len(prompt)  # without it, every position's logits
    assert lean.token_ids == full.token_ids


def test_a_long_prompt_goes_through_in_pieces_with_the_same_answer(tiny_model: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """engine/generate.py runs a prompt PREFILL_TOKENS tokens at a time, each piece attending to the
    cache of those before (the estimate's generation phase holds one piece's working set): pieces of
    7 tokens give the greedy answer and the first new token's logits of a single pass."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import studio.engine.generate as gen
    from studio.core.memory import phases

    assert gen.PREFILL_TOKENS is phases.PREFILL_TOKENS  # one home: the estimate's
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    pieces, firsts = [], []

    def hook(module, args, kwargs, out):
        pieces.append(kwargs["input_ids"].shape[1])
        if len(pieces) == 1 or kwargs["input_ids"].shape[1] > 1:
            firsts.append(out.logits[0, -1].detach().clone())

    model.get_base_model().register_forward_hook(hook, with_kwargs=True)
    # The tiny model may answer EOS first (it did on the GPU box's build): then no one-token pass
    # would follow the prompt's pieces, and the test would prove less. All 6 tokens are generated.
    monkeypatch.setattr(gen, "stop_ids", lambda model, tokenizer: set())
    prompt = gen.prompt_ids(tokenizer, "reverse the words of this fairly long sentence please " * 3)
    whole = gen.generate(model, tokenizer, prompt, max_new_tokens=6, device="cpu")
    assert pieces[0] == len(prompt) > 20
    one_pass_logits = firsts[0]
    pieces.clear(), firsts.clear()
    monkeypatch.setattr(gen, "PREFILL_TOKENS", 7)
    cut = gen.generate(model, tokenizer, prompt, max_new_tokens=6, device="cpu")
    n = -(-len(prompt) // 7)
    assert pieces[:n] == [7] * (n - 1) + [len(prompt) - 7 * (n - 1)] and set(pieces[n:]) == {1}
    assert torch.allclose(firsts[-1], one_pass_logits, atol=1e-4)
    assert cut.token_ids == whole.token_ids and len(cut.token_ids) == 6 and not cut.kv_on_host


def test_the_session_keeps_an_answers_cache_on_the_card_off_cuda(tiny_config):
    """The host-resident KV cache is a CUDA measure: on the CPU the session never asks for it, and
    generate ignores the flag there."""
    import torch

    from studio.engine.session import Session

    session = Session(tiny_config, run=None, emit=lambda _event: None, device=torch.device("cpu"))  # type: ignore[arg-type]
    assert session.answer_kv_on_host(4096, 128) is False


# ---------------------------------------------------------------------------------- the estimate

def _llama7():
    from studio.core.model.info import KNOWN_MODELS

    return KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]


def test_every_phase_has_a_peak_and_the_estimate_is_the_largest():
    """Llama-2-7B (32 key/value heads) on the fast path, one 4096-token row a micro-batch: a chat
    prompt as long as a training row would keep 32 x 2 x 4096 x (4096 + 128) bf16 values of KV cache
    (2.2 GB) on the card, more than the training step's layer inputs, so the cache goes to the host,
    three layers of it on the card, and generation does not set the peak; the evaluation of a
    4096-token row between two steps comes out 0.18 GiB above the step (no H100 row measured an
    evaluation between steps: theirs came after the last), and its moment's categories hold the gradients CUDA graphs keep between steps. Sixteen 512-token rows a micro-batch (an
    eager step): the step sets the peak, and the answer's cache (prompt and answer) stays on the card."""
    from studio.core.memory import CUDA_CONTEXT_BYTES, PHASES, Plan, estimate_plan
    from studio.core.memory.phases import KV_LAYERS_ON_CARD

    plan = Plan(lora_dropout=0.0, micro_batch=1, seq_len=4096, path="fast")
    long = estimate_plan(_llama7(), plan)
    assert tuple(long.phases) == PHASES
    assert long.peak_reserved == max(p.reserved for p in long.phases.values())
    assert long.peak_allocated == max(p.allocated for p in long.phases.values())
    kv = 32 * 2 * 4096 * (4096 + 128) * 2
    gen, save = long.phases["generation"], long.phases["checkpoint save"]
    assert gen.host_kv and gen.to_json_dict()["kv_cache"] == "host" and "on the host" in gen.held
    assert long.peak_phase != "generation" and gen.reserved == long.phases["training step"].reserved
    # an evaluation between two steps: its pass beside the pool and the graphs' gradient tensors
    assert long.peak_reserved <= 1.04 * long.phases["training step"].reserved
    on_card = kv * KV_LAYERS_ON_CARD / 32
    assert on_card < gen.allocated - save.allocated < on_card + 0.6e9  # three layers' cache, the prompt's pass
    assert gen.allocated < long.phases["training step"].allocated
    assert long.peak_phase == "evaluation" and long.peak_reserved > long.phases["training step"].reserved
    # between two graphed steps the graphs' fixed gradient tensors stay (engine/fast/graphs.py's GradSink)
    assert long.categories["gradients"] == long.phases["evaluation"].gradients == long.step_categories["gradients"]
    assert long.total == sum(long.categories.values()) == long.peak_reserved + CUDA_CONTEXT_BYTES
    assert long.step_categories["gradients"] > 0

    short = estimate_plan(_llama7(), Plan(lora_dropout=0.0, micro_batch=16, seq_len=512, path="fast"))
    assert short.peak_phase == "training step" and short.categories == short.step_categories
    assert all(p.reserved >= short.phases["training step"].reserved for p in short.phases.values())
    gen, save = short.phases["generation"], short.phases["checkpoint save"]
    assert not gen.host_kv and "kv_cache" not in gen.to_json_dict()
    kv = 32 * 2 * 4096 * (512 + 128) * 2
    assert kv < gen.allocated - save.allocated < kv + 0.6e9  # the whole cache plus the prompt's pass


def test_evaluation_on_the_fast_path_scores_512_tokens_a_pass():
    """FastModel.score runs SCORE_TOKENS (512) tokens a pass, a longer row alone; the plain path's
    evaluation runs the whole micro-batch with its logits, under its training step's peak."""
    from studio.core.memory import Plan, estimate_plan
    from studio.core.memory.phases import SCORE_TOKENS, eval_tokens
    from studio.engine.fast.model import SCORE_TOKENS as ENGINE_SCORE_TOKENS

    assert SCORE_TOKENS is ENGINE_SCORE_TOKENS  # one home: the engine imports it
    assert eval_tokens(Plan(micro_batch=16, seq_len=512, path="fast")) == 512
    assert eval_tokens(Plan(micro_batch=16, seq_len=128, path="fast")) == 512
    assert eval_tokens(Plan(micro_batch=2, seq_len=4096, path="fast")) == 4096
    assert eval_tokens(Plan(micro_batch=16, seq_len=512, path="plain")) == 8192
    # issue 18: micro-batch 32 trained under 15 GB and died in the evaluation's fp32 logits; the
    # fast path's evaluation now stays under its step at every micro-batch
    for mb in (8, 16, 24, 32):
        e = estimate_plan(_llama7(), Plan(lora_dropout=0.0, micro_batch=mb, seq_len=512, path="fast"))
        assert e.phases["evaluation"].allocated < e.phases["training step"].allocated
    plain = estimate_plan(_llama7(), Plan(lora_dropout=0.0, micro_batch=16, seq_len=512, path="plain"))
    assert plain.phases["evaluation"].allocated < plain.phases["training step"].allocated


def test_studio_estimate_says_which_phase_sets_the_peak(tmp_path, capsys):
    from argparse import Namespace

    from studio.cli.estimate import main

    path = tmp_path / "run.yaml"
    path.write_text("model: {base_model: meta-llama/Llama-2-7b-hf}\ndata: {max_seq_length: 4096}\n"
                    "trainer: {micro_batch_size: 1, gradient_accumulation_steps: 1}\n")
    assert main(Namespace(config=str(path), gpu_gb=24.0, json=True, model=None)) == 0
    data = json.loads(capsys.readouterr().out)
    # a chat prompt as long as a training row: its KV cache (2.2 GB) goes to the host, and the
    # answer no longer sets the peak (on the card it would: the test above)
    assert data["peak_phase"] != "generation" and set(data["phases"]) == {
        "training step", "evaluation", "generation", "checkpoint save"}
    assert data["phases"]["generation"]["kv_cache"] == "host"
    assert data["plan"]["token_lengths"] == {"source": "max_seq_length"}
    assert main(Namespace(config=str(path), gpu_gb=24.0, json=False, model=None)) == 0
    out = capsys.readouterr().out
    assert f"peak set by the {data['peak_phase']}" in out
    assert "KV cache of 4096 + 128 tokens (2.21 GB) on the host, 3 layers of it on the card" in out


# ------------------------------------------------------------------------------- data lengths

def test_unpacked_steps_are_sized_from_the_datas_token_lengths(tiny_config, capsys, tmp_path):
    """Without packing a micro-batch holds at most its rows' real tokens (the fast path unpads):
    the sum of the micro_batch longest examples, each capped at max_seq_length, computed with the
    run's tokenizer as the engine encodes the rows; packed runs keep max_seq_length."""
    from argparse import Namespace

    import yaml

    from studio.cli.estimate import main
    from studio.core.memory import estimate
    from studio.core.memory.lengths import data_lengths
    from studio.core.model.info import load_model_info

    lengths, why = data_lengths(tiny_config)
    assert why == "" and len(lengths) == 2920 and list(lengths) == sorted(lengths, reverse=True)
    assert 10 < lengths[0] <= 64 and lengths[-1] >= 5
    info = load_model_info(tiny_config.model.base_model)
    sized = estimate(tiny_config, info, lengths=lengths)
    assert sized.plan.data_sized and sized.plan.real_tokens == sum(lengths[:8]) < 8 * 64
    assert sized.plan.tokens == 8 * lengths[0]  # the plain path pads to the longest row
    full = estimate(tiny_config, info)
    assert sized.phases["training step"].allocated < full.phases["training step"].allocated
    tiny_config.trainer.packing = True
    assert not estimate(tiny_config, info, lengths=lengths).plan.data_sized
    # studio estimate reads the data and the tokenizer when both are here
    tiny_config.trainer.packing = False
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config.to_dict()))
    assert main(Namespace(config=str(path), gpu_gb=16.0, json=True, model=None)) == 0
    lengths_json = json.loads(capsys.readouterr().out)["plan"]["token_lengths"]
    assert lengths_json == {"source": "data", "longest": lengths[0], "micro_batch_tokens": sum(lengths[:8]),
                            "examples": 2920}


def test_the_short_padded_h100_row_is_sized_from_its_rows():
    """The bench's short rows re-encoded offline (bench/vram_accuracy.py short_lengths): the
    seq1024 mb4 padded row's micro-batch is the four longest rows, not 4 x 1024 tokens."""
    from bench.vram_accuracy import ALL_LINEAR, Case, short_lengths

    lengths = short_lengths(1024)
    if not lengths:
        pytest.skip("the tiny tokenizer is not built here")
    case = Case("llama2-7b", "nf4", 16, ALL_LINEAR, 1024, 4, True, expandable=True, engine="trainer",
                data="short", packing=False)
    plan = case.plan()
    assert plan.data_sized and plan.real_tokens == sum(lengths[:4]) < 1024
    assert not Case(**{**case.__dict__, "packing": True}).plan().data_sized


# -------------------------------------------------------------------- Phi-3 and the path facts

def test_phi3_all_linear_is_estimated_with_its_fused_module_names(tmp_path, capsys):
    """`studio estimate` on a Phi-3 config with all-linear (or Llama names) maps the targets onto
    qkv_proj / gate_up_proj through ModelInfo.lora_targets, the function the VRAM pane uses too."""
    from argparse import Namespace

    from helpers.model_configs import CONFIGS

    from studio.cli.estimate import main
    from studio.core.config import parse_config
    from studio.core.memory import estimate, walkthrough
    from studio.core.model.info import from_config_dict
    from studio.ui.panes.vram import model_for_estimate

    folder = tmp_path / "phi3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS["phi-3-mini"]))
    info = from_config_dict(CONFIGS["phi-3-mini"], "phi3")
    assert info.lora_targets("all-linear") == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert info.lora_targets(["q_proj", "v_proj", "up_proj"]) == ("qkv_proj", "gate_up_proj")
    config = parse_config(f"model: {{base_model: {folder}}}\nlora: {{target_modules: all-linear}}\n"
                          "trainer: {micro_batch_size: 2}\n")
    result = estimate(config, info)
    assert result.plan.lora_targets == info.lora_targets("all-linear") and result.path == "fast"
    assert len(walkthrough(config, info)) == 7
    path = tmp_path / "phi3.yaml"
    path.write_text(f"model: {{base_model: {folder}}}\nlora: {{target_modules: all-linear}}\n")
    assert main(Namespace(config=str(path), gpu_gb=16.0, json=True, model=None)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["lora_targets"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    pane_info, _ = model_for_estimate(config, str(folder))
    assert tuple(config.lora.target_modules) == pane_info.lora_targets("all-linear")


def test_the_estimator_and_the_loader_build_path_facts_in_one_place(tiny_model, monkeypatch):
    """core/memory/estimate.py's path_choice and engine/model.py's fast_path_ahead both take their facts from
    PathFacts.from_config, and agree on the same config."""
    import torch
    from transformers import AutoModelForCausalLM

    from studio.core import plan as core_plan
    from studio.core.config import parse_config
    from studio.core.memory import path_choice
    from studio.core.model.info import load_model_info
    from studio.engine.model import fast_path_ahead

    made = []
    real = core_plan.PathFacts.from_config.__func__

    def spy(cls, config, **kwargs):
        facts = real(cls, config, **kwargs)
        made.append(facts)
        return facts

    monkeypatch.setattr(core_plan.PathFacts, "from_config", classmethod(spy))
    monkeypatch.setenv("STUDIO_FAST_PATH", "1")
    config = parse_config(f"model: {{base_model: {tiny_model}}}\nquantization: {{bits: null}}\n"
                          "lora: {target_modules: all-linear, dropout: 0.0}\n")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ahead = fast_path_ahead(model, config)
    choice = path_choice(config, load_model_info(str(tiny_model)))
    assert len(made) == 2 and made[0].lora_targets == made[1].lora_targets
    assert ahead is (choice.path == "fast") is True
    config.lora = None  # a full fine-tune: the plain path for both
    assert not fast_path_ahead(model, config)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the host-resident KV cache is a CUDA measure")
def test_an_answer_with_its_kv_cache_on_the_host_is_the_same_answer(tiny_model: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """On a GPU, ``kv_on_host`` keeps every layer's cache in host memory (transformers'
    ``DynamicCache(offloading=True)``); the greedy answer is token for token the on-card one, over
    a prompt long enough to go through in pieces."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import studio.engine.generate as gen

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).cuda()
    monkeypatch.setattr(gen, "PREFILL_TOKENS", 32)  # the tiny model has 512 positions
    monkeypatch.setattr(gen, "stop_ids", lambda model, tokenizer: set())  # untrained: EOS may come first
    prompt = gen.prompt_ids(tokenizer, "reverse the words of this fairly long sentence please " * 8)
    assert 2 * 32 < len(prompt) < 400
    card = gen.generate(model, tokenizer, prompt, max_new_tokens=12, device="cuda")
    host = gen.generate(model, tokenizer, prompt, max_new_tokens=12, device="cuda", kv_on_host=True)
    assert host.kv_on_host and not card.kv_on_host
    assert host.token_ids == card.token_ids and len(host.token_ids) == 12
