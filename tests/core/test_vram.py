"""The memory estimator against hand-computed values and what the GPU showed of each mechanism.

Its accuracy over whole runs of today's engine is tests/core/test_vram_measured.py's."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import REPO

from studio.cli.estimate import main as estimate_main
from studio.core.config import RunConfig, parse_config
from studio.core.memory import ALL_LINEAR, CATEGORIES, Plan, estimate, estimate_plan, plan_for, walkthrough
from studio.core.memory.allocator import CUBLAS_WORKSPACE_BYTES, PAGE, expandable_segments_from_env
from studio.core.memory.gpus import GB, gpu_for_size
from studio.core.memory.params import lora_params, weight_bytes
from studio.core.memory.plain import (
    INT8_THRESHOLD,
    int8_outlier_fractions,
    loss_blocks_pinned,
    small_pool_trainable,
    swiglu_tail,
    workspace_pins_loss_expandable,
)
from studio.core.model.info import KNOWN_MODELS, ModelInfoError, load_model_info
from studio.core.plan import graphs_for

LLAMA7 = KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]
SMOL = KNOWN_MODELS["HuggingFaceTB/SmolLM2-135M"]
# QLoRA on the plain path: NF4 double quant, bf16 compute, LoRA r16 on all 7 projections, AdamW;
# PyTorch's default allocator (fixed segments).
QLORA7 = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, expandable_segments=False)


def test_lora_parameter_count_matches_peft_on_llama_2_7b():
    # per layer: r * (in + out) for q, k, v, o (4096 -> 4096) and gate, up (4096 -> 11008), down back
    by_hand = 32 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert by_hand == 39_976_960
    assert lora_params(LLAMA7, 16, ALL_LINEAR) == by_hand
    assert lora_params(LLAMA7, 8, ("q_proj", "v_proj")) == 32 * 8 * 2 * (4096 + 4096)


def test_nf4_weights_are_packed_data_plus_constants_plus_fp32_rest():
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    blocks_per_layer = [4096 * 4096 // 64] * 4 + [4096 * 11008 // 64] * 3
    double_quant = 32 * sum(b + 4 * -(-b // 256) + 1024 + 4 + 64 for b in blocks_per_layer)
    rest = 2 * 32000 * 4096 + 65 * 4096  # embeddings, lm_head, norms: fp32 after prepare_model_for_kbit
    assert weight_bytes(LLAMA7, QLORA7) == linear // 2 + double_quant + rest * 4
    # without double quant the absmax constants are fp32 per 64 weights: 0.5 bit a weight more
    single = weight_bytes(LLAMA7, replace(QLORA7, double_quant=False))
    assert single - weight_bytes(LLAMA7, QLORA7) == pytest.approx(linear * (4 / 64 - 1 / 64), rel=0.01)
    # measured on the H100 after prepare_model_for_kbit_training: 4.401 GB
    assert weight_bytes(LLAMA7, QLORA7) / GB == pytest.approx(4.401, rel=0.01)


def test_full_fp32_fine_tuning_is_16_bytes_a_parameter_plus_activations():
    full = Plan(weights="fp32", compute="fp32", lora_r=None, checkpointing=False)
    result = estimate_plan(LLAMA7, full, gpu_bytes=80 * GB)
    c = result.categories
    assert c["weights"] + c["gradients"] + c["optimizer"] == 16 * LLAMA7.total_params()
    assert c["weights"] / GB == pytest.approx(27, rel=0.03)  # "~28 GB of fp32 weights"
    assert 96 * GB < result.total and not result.fits


def test_categories_sum_to_the_total_and_overhead_holds_the_cuda_context():
    result = estimate_plan(SMOL, Plan())
    assert list(result.categories) == list(CATEGORIES)
    assert sum(result.categories.values()) == result.total
    assert result.total == result.peak_reserved + result.categories["overhead"] - (
        result.peak_reserved - result.peak_allocated)
    assert result.categories["overhead"] >= 500 * 2**20


def test_activations_grow_with_tokens_and_shrink_with_checkpointing():
    small = estimate_plan(LLAMA7, replace(QLORA7, micro_batch=1, checkpointing=False))
    big = estimate_plan(LLAMA7, replace(QLORA7, micro_batch=4, checkpointing=False))
    ckpt = estimate_plan(LLAMA7, replace(QLORA7, micro_batch=4, checkpointing=True))
    assert big.categories["activations"] > 3 * small.categories["activations"]
    assert ckpt.categories["activations"] < big.categories["activations"] / 5
    # ~10.3 MB a token without checkpointing on the H100 (the benchmark's HF + PEFT loop, whose loss
    # keeps 2 bytes a vocabulary entry more than the Trainer's: 64 KB a token of these 10.3 MB)
    per_token = (big.categories["activations"] - small.categories["activations"]) / (3 * 512)
    assert per_token / 1e6 == pytest.approx(10.3, rel=0.08)


def test_eager_attention_adds_a_quadratic_term_that_sdpa_does_not_have():
    short, long = (replace(QLORA7, seq_len=s, checkpointing=False) for s in (1024, 4096))
    for attention, grows_quadratically in (("sdpa", False), ("eager", True)):
        a = estimate_plan(LLAMA7, replace(short, attention=attention)).categories["activations"]
        b = estimate_plan(LLAMA7, replace(long, attention=attention)).categories["activations"]
        assert (b / a > 4.5) is grows_quadratically


def test_paged_8bit_optimizer_is_a_quarter_of_adamw_and_not_in_torch_allocated():
    adam = estimate_plan(LLAMA7, QLORA7)
    paged = estimate_plan(LLAMA7, replace(QLORA7, optimizer="paged_adamw_8bit"))
    assert paged.categories["optimizer"] == pytest.approx(adam.categories["optimizer"] / 4, rel=0.02)
    assert paged.peak_allocated == adam.peak_allocated - adam.categories["optimizer"]
    assert any("paged" in note for note in paged.notes)


def test_max_micro_batch_is_the_largest_that_fits():
    capacity = gpu_for_size(16).capacity
    result = estimate_plan(LLAMA7, QLORA7, gpu_bytes=capacity)
    n = result.max_micro_batch
    assert n and n > 1
    assert estimate_plan(LLAMA7, replace(QLORA7, micro_batch=n)).total <= capacity
    assert estimate_plan(LLAMA7, replace(QLORA7, micro_batch=n + 1)).total > capacity
    full = Plan(weights="fp32", compute="fp32", lora_r=None)
    assert estimate_plan(LLAMA7, full, gpu_bytes=capacity).max_micro_batch == 0


def test_plan_follows_the_run_config():
    config = parse_config("quantization: {bits: null}\nlora: {r: 8, target_modules: [q_proj, v_proj]}\n"
                          "trainer: {micro_batch_size: 2, gradient_checkpointing: false, "
                          "optimizer: paged_adamw_8bit}\ndata: {max_seq_length: 1024}\n")
    plan = plan_for(config)
    assert (plan.weights, plan.lora_r, plan.lora_targets) == ("bf16", 8, ("q_proj", "v_proj"))
    assert (plan.micro_batch, plan.seq_len, plan.checkpointing) == (2, 1024, False)
    assert plan_for(RunConfig()).lora_targets == ALL_LINEAR
    assert estimate(config, SMOL, micro_batch=6).plan.micro_batch == 6
    with pytest.raises(ValueError, match="lora.target_modules"):
        estimate(parse_config("lora: {target_modules: [c_attn]}\n"), SMOL)


def test_walkthrough_tells_the_story_from_full_fp32_to_paged_qlora():
    steps = walkthrough(RunConfig(), LLAMA7, 24 * GB)
    assert [s.title for s in steps][0].startswith("Full fine-tune, fp32")
    assert len(steps) == 7 and all(s.why for s in steps)
    totals = [s.estimate.total for s in steps]
    assert totals[0] > 100 * GB and totals[-1] < 12 * GB
    assert steps[0].estimate.fits is False and steps[-1].estimate.fits is True
    assert totals[5] < totals[4]  # checkpointing
    assert steps[-1].estimate.categories["optimizer"] < steps[-2].estimate.categories["optimizer"]


def test_model_info_comes_from_a_folder_the_table_or_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": True}))
    info = load_model_info(str(tmp_path))
    assert (info.hidden, info.kv_heads, info.tied, info.head_width) == (64, 2, True, 16)
    assert load_model_info("HuggingFaceTB/SmolLM2-135M-Instruct").vocab == 49152
    with pytest.raises(ModelInfoError, match="no/such-model"):
        load_model_info("no/such-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelInfoError, match="hidden_size"):
        load_model_info(str(tmp_path))


def test_cli_json_has_exactly_the_documented_keys(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: {base_model: meta-llama/Llama-2-7b-hf}\n")
    assert estimate_main(Namespace(config=str(path), gpu_gb=16.0, json=True, model=None)) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"categories", "total", "capacity", "fits", "max_micro_batch", "path", "plan", "auto_plan",
                         "peak_phase", "phases"}
    # a 4-bit Llama with LoRA on the seven projections takes the GPU fast path (core/plan.py decides)
    assert data["path"] == "fast" and data["plan"]["path"] == "fast" and data["plan"]["cuda_graphs"] is True
    assert data["plan"]["micro_batch"] == data["auto_plan"]["chosen"]["micro_batch_size"]  # auto: the planned one
    assert data["plan"]["weights"] == "nf4" and data["plan"]["reason"]
    assert list(data["categories"]) == list(CATEGORIES)
    assert data["total"] == sum(data["categories"].values()) and data["fits"] is True
    assert estimate_main(Namespace(config=str(path), gpu_gb=4.0, json=False, model=None)) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "activations" in out and "path: fast" in out


def test_cli_errors_name_the_file_and_do_not_trace(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: {micro_batch_sise: 2}\n")
    assert estimate_main(Namespace(config=str(path), gpu_gb=None, json=False, model=None)) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "micro_batch_size" in err and "Traceback" not in err


def test_estimator_does_not_import_torch():
    code = ("import sys, studio.core.memory, studio.cli.estimate, studio.core.memory.gpus; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_estimators_modules_import_each_other_in_one_direction():
    """core/memory/'s modules import only those below them (its package docstring lists the order):
    no module reads another that reads it back."""
    import ast

    import studio.core.memory as memory

    order = ["gpus", "allocator", "plan", "params", "result", "plain", "attention", "fast", "expert_groups", "phases",
             "estimate", "walkthrough", "lengths", "autoplan", "multigpu"]
    folder = Path(memory.__file__).parent
    assert sorted(order) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    for name in order:
        tree = ast.parse((folder / f"{name}.py").read_text())
        modules = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert "studio.core.memory" not in modules, f"{name} imports the package, which imports every module"
        imported = {m.rsplit(".", 1)[-1] for m in modules if m.startswith("studio.core.memory.")}
        assert all(order.index(other) < order.index(name) for other in imported), (name, imported)


# ------------------------------------------------------------- LLM.int8 and the caching allocator

INT8_QLORA = replace(QLORA7, weights="int8", micro_batch=2, seq_len=512)


def test_int8_inputs_survive_checkpointing_unlike_nf4():
    # bitsandbytes' MatMul8bitLt keeps its input as a ctx attribute, which checkpointing cannot drop:
    # per token and layer the q/k/v input and the gate/up input (fp32 stream), the o_proj input
    # (bf16) and the down_proj input (fp32), plus its outlier columns (almost all at 7B width)
    int8 = estimate_plan(LLAMA7, INT8_QLORA).categories["activations"]
    nf4 = estimate_plan(LLAMA7, replace(INT8_QLORA, weights="nf4")).categories["activations"]
    inputs = 1024 * 32 * (4 * 4096 + 2 * 4096 + 4 * 4096 + 4 * 11008)
    outliers = 1024 * 32 * 4 * 11008
    assert int8 - nf4 == pytest.approx(inputs + outliers, rel=0.1)
    # H100, bitsandbytes 0.50.2, random weights: 13.63 GB peak allocated (a layer's backward)
    assert estimate_plan(LLAMA7, INT8_QLORA).peak_allocated / GB == pytest.approx(13.63, rel=0.05)


def test_int8_outlier_columns_depend_on_width_and_tokens():
    normed, wide = int8_outlier_fractions(LLAMA7, INT8_QLORA)
    _, narrow = int8_outlier_fractions(SMOL, replace(INT8_QLORA, micro_batch=8))
    assert normed < 1e-4 and narrow < 1e-6 and wide > 0.9
    _, few_tokens = int8_outlier_fractions(LLAMA7, replace(INT8_QLORA, micro_batch=1, seq_len=64))
    assert few_tokens < wide


def test_swiglu_tail_matches_sampling():
    # P(|silu(g) * u| >= 6) for g, u ~ N(0, sigma^2): the integral against 200k samples
    rng = random.Random(0)
    sigma, n = 0.02 * 4096 ** 0.5, 200_000
    hits = sum(abs(g / (1 + math.exp(-g)) * rng.gauss(0, sigma)) >= INT8_THRESHOLD
               for g in (rng.gauss(0, sigma) for _ in range(n)))
    assert swiglu_tail(sigma, INT8_THRESHOLD) == pytest.approx(hits / n, rel=0.15)


def test_reserved_at_the_loss_holds_an_extra_fp32_logits_block():
    # SmolLM2's 49k vocabulary makes the loss the peak: with fixed segments, reserved - allocated
    # exceeds one fp32 logits block (4 bytes x tokens x vocab), the one the pinned workspace splits
    plan = replace(INT8_QLORA, micro_batch=8)
    result = estimate_plan(SMOL, plan)
    assert result.peak_reserved - result.peak_allocated > 4 * 4096 * 49152


def test_loss_blocks_are_reused_when_the_forward_leaves_a_block_for_the_workspace():
    # SmolLM2 nf4 ckpt, 8 x 1024 tokens: each checkpointed layer frees its 48 MiB fp32 gate/up
    # outputs, the backward thread's 32 MiB cuBLAS workspace goes there, and the next step's loss gets
    # the cached logits blocks back (fixed segments)
    plan = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.05, micro_batch=8,
                seq_len=1024, checkpointing=True, expandable_segments=False)
    assert not loss_blocks_pinned(SMOL, plan)
    result = estimate_plan(SMOL, plan)
    assert result.peak_reserved - result.peak_allocated < 4 * 8192 * 49152
    # 8 x 512 tokens: the freed gate/up blocks are 24 MiB, too small: the workspace pins a logits block
    half = estimate_plan(SMOL, replace(plan, seq_len=512))
    assert loss_blocks_pinned(SMOL, half.plan)
    assert half.peak_reserved - half.peak_allocated > 4 * 4096 * 49152


def test_expandable_segments_add_the_small_pool_peak_that_comes_later():
    # Llama-3-8B QLoRA r16: every LoRA matrix is under 1 MiB, so the adapters, their gradients and
    # AdamW's foreach temporary live in the small pool, which peaks at the optimizer step; the overall
    # allocated peak (the loss: a 128k vocabulary) comes before any gradient exists. Reserved is the
    # sum of the two pools' high-water marks: allocated + gradients + temporary (2 x 4 bytes x 41.9M),
    # in mapping steps (the H100's allocator trace of Llama-2-7B under transformers' own loss showed it).
    llama3 = KNOWN_MODELS["meta-llama/Meta-Llama-3-8B"]
    plan = replace(QLORA7, micro_batch=4, seq_len=512)
    fixed = estimate_plan(llama3, plan)
    grown = estimate_plan(llama3, replace(plan, expandable_segments=True))
    assert grown.peak_allocated == fixed.peak_allocated
    lora = lora_params(llama3, 16, ALL_LINEAR)
    assert small_pool_trainable(llama3, plan) == lora
    gap = grown.peak_reserved - grown.peak_allocated
    assert 2 * 4 * lora <= gap <= 2 * 4 * lora + 20 * 2**20 + 4 * 2**20
    assert grown.peak_reserved < fixed.peak_reserved  # freed blocks merge: less slack than segments


def test_expandable_small_pool_takes_only_tensors_up_to_one_mib():
    # r64: a 64 x 4096 fp32 matrix is exactly 1 MiB (small pool); 64 x 11008 ones go to the large
    # pool, so only 352 MiB of the 610 MiB of adapters add their gradient and temporary to the gap
    plan = replace(QLORA7, lora_r=64, micro_batch=2, seq_len=4096, lora_dropout=0.05, expandable_segments=True)
    assert small_pool_trainable(LLAMA7, plan) == 32 * 64 * (8 * 4096 + 2 * 4096 + 4096)
    result = estimate_plan(LLAMA7, plan)
    assert result.peak_reserved / GB == pytest.approx(16.070, rel=0.05)  # measured on the H100


def test_expandable_workspace_in_the_logits_range_shifts_the_next_loss_by_itself():
    # SmolLM2 nf4 ckpt, 8 x 1024 tokens: the forward leaves no hole of 32 MiB in the one segment (the
    # saved hidden states are carved out of the freed working sets), so the backward's cuBLAS workspace
    # settles in the freed logits range; the Trainer's loss frees its bf16 logits before lm_head's
    # product, so the workspace sits at the range's start and every later loss starts one workspace on.
    plan = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.05, micro_batch=8,
                seq_len=1024, checkpointing=True, expandable_segments=True)
    assert workspace_pins_loss_expandable(SMOL, plan)
    result = estimate_plan(SMOL, plan)
    assert CUBLAS_WORKSPACE_BYTES <= result.peak_reserved - result.peak_allocated < 8192 * SMOL.vocab * 2
    # Llama-2-7B at 2048 tokens: three freed 4096-wide bf16 tensors make a 48 MiB hole; no shift
    llama = replace(QLORA7, micro_batch=4, seq_len=512, expandable_segments=True)
    assert not workspace_pins_loss_expandable(LLAMA7, llama)


def test_a_pinned_workspace_shifts_the_trainers_loss_by_the_workspace_only():
    # The Trainer's loss drops its bf16 logits at the end of the forward, so the backward's workspace
    # lands at the start of the freed range: the next loss moves by the workspace, not by a bf16
    # logits block. SmolLM2 int8 r16 seq512 mb8 through the Trainer on the H100: 4.215 GiB allocated,
    # 4.359 reserved.
    trainer = Plan(weights="int8", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=8,
                   seq_len=512, checkpointing=True, expandable_segments=True)
    assert workspace_pins_loss_expandable(SMOL, trainer)
    result = estimate_plan(SMOL, trainer)
    assert result.peak_reserved - result.peak_allocated < 4096 * SMOL.vocab * 2  # under one bf16 logits block
    assert result.peak_reserved / 2**30 == pytest.approx(4.359, rel=0.03)
    assert result.peak_allocated / 2**30 == pytest.approx(4.215, rel=0.03)


def test_workspace_rules_match_every_h100_allocator_trace():
    """Where the backward's cuBLAS workspace landed in 20 allocator traces on the H100
    (tests/data/allocator_workspace_traces.json): in the loss's freed logits range exactly where the
    rule for the run's allocator mode says the forward left no block large enough."""
    from studio.core.model.info import from_config_dict

    traces = json.loads((REPO / "tests/data/allocator_workspace_traces.json").read_text())
    infos = {name: from_config_dict(dict(config), name) for name, config in traces["models"].items()}
    assert len(traces["rows"]) == 20  # 18 expandable rows, 2 default ones
    for row in traces["rows"]:
        plan = Plan(**{**row["plan"], "lora_targets": tuple(row["plan"]["lora_targets"])})
        rule = workspace_pins_loss_expandable if plan.expandable_segments else loss_blocks_pinned
        assert rule(infos[row["model"]], plan) is row["in_the_logits_range"], row["trace"]
    assert {row["in_the_logits_range"] for row in traces["rows"]} == {True, False}


@pytest.mark.parametrize("value,expandable", [
    (None, True),  # unset: Studio's engine sets expandable_segments:True
    ("expandable_segments:False", False),
    ("max_split_size_mb:128", False),  # the user's own setting, without expandable segments
    ("garbage_collection_threshold:0.6, expandable_segments:True", True),
])
def test_allocator_mode_follows_what_the_engine_will_see(value, expandable, monkeypatch):
    assert expandable_segments_from_env(value) is expandable
    if value is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
    assert plan_for(RunConfig()).expandable_segments is expandable


def test_the_estimate_follows_the_engines_path_decision(monkeypatch):
    """core/plan.py decides for both: 4-bit Llama with LoRA on the projections is the fast path, an
    8-bit base the plain one; the fast path (no fp32 stream, no logits) needs less at micro-batch 16."""
    info = load_model_info("meta-llama/Llama-2-7b-hf")
    fast = estimate(parse_config("trainer: {micro_batch_size: 16}\n"), info)
    plain = estimate(parse_config("trainer: {micro_batch_size: 16}\nquantization: {bits: 8}\n"), info)
    assert fast.path == "fast" and fast.choice is not None and fast.choice.cuda_graphs
    assert plain.path == "plain" and "8-bit" in plain.choice.reason
    monkeypatch.setenv("STUDIO_FAST_PATH", "0")  # what the engine reads, the estimate reads too
    assert estimate(parse_config("trainer: {micro_batch_size: 16}\n"), info).path == "plain"
    assert fast.notes[0].startswith("fast path")
    as_plain = estimate_plan(info, replace(fast.plan, path="plain"))
    assert fast.peak_allocated < as_plain.peak_allocated


# ----------------------------------------------------------------------------------- the fast path

FAST7 = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=4, seq_len=512,
             path="fast")
"""Llama-2-7B QLoRA r16 on all projections on the fast path, 2048 tokens a micro-batch: a CUDA graph."""


def test_the_fast_paths_layer_keeps_inputs_and_qkv_on_the_host():
    """Today's engine (engine/fast/offload.py) keeps every layer's input and rotated q, k and v in
    host memory on a CUDA card, eager and graphed steps alike: on the device at a backward's start
    are two layer inputs and one layer's q, k and v, whatever the depth. Its recomputed layer
    (engine/fast/layer.py) outputs the two norms, q, k, v, attention, o_proj onto the residual,
    gate/up and SwiGLU (no RoPE copies, no down_proj)."""
    from studio.core.memory import fast

    h, i = 4096, 11008
    assert fast.layer_outputs_per_token(LLAMA7, 2) == 2 * (2 * h + 3 * h + h + h + 3 * i)
    assert fast.saved_per_token(LLAMA7, 2) == 2 * (2 * h + 3 * h)
    deep = replace(LLAMA7, layers=64)
    step = estimate_plan(LLAMA7, FAST7).step_categories
    deeper = estimate_plan(deep, FAST7).step_categories
    assert deeper["activations"] - step["activations"] == fast.hoisted_adapter_bytes(deep, 16, ALL_LINEAR, 2) \
        - fast.hoisted_adapter_bytes(LLAMA7, 16, ALL_LINEAR, 2)  # only the adapters grow with depth


def test_grouped_query_attention_keeps_the_repeated_keys_and_values_in_the_recomputed_layer():
    """With fewer key/value heads than query heads, engine/fast/attention.py repeats k and v to the
    query heads' count where the kernel cannot take fewer (SDPA rows; torch 2.11's varlen attention)
    and the attention saves both for its backward: SmolLM2-135M's 9 query heads on 3 key/value heads
    hold two more 576-wide tensors a token in the recomputed layer than its own k and v. This was the
    16384-token SmolLM2 row of tests/data/vram_measured.json, 7.3% under before it was counted."""
    from studio.core.memory import fast

    h, i, q, kv = SMOL.hidden, SMOL.intermediate, SMOL.heads * SMOL.head_width, SMOL.kv_heads * SMOL.head_width
    assert (q, kv) == (576, 192)
    assert fast.layer_outputs_per_token(SMOL, 2) == 2 * (2 * h + (q + 2 * kv) + 2 * q + q + h + 3 * i)
    same_heads = replace(SMOL, kv_heads=SMOL.heads)
    assert fast.layer_outputs_per_token(same_heads, 2) == 2 * (2 * h + 3 * q + q + h + 3 * i)  # no copies


def test_an_eager_step_frees_each_layers_adapters_as_its_gradients_appear():
    """A step too large for a CUDA graph runs eagerly after the gradients were set to None: each
    layer's hoisted adapters (saved by engine/fast/offload.py's OffloadedLayer) are freed as that
    layer's backward writes its gradients, so the peak holds two layers' adapters beside the other
    layers' gradients, and a deeper model's activations at the peak do not grow. A graphed step
    (gradients in fixed tensors from the start) or a later micro-batch of an accumulated step holds
    every layer's adapters beside every gradient: there they grow with the depth."""
    from studio.core.memory import fast

    deep = replace(LLAMA7, layers=64)
    extra_adapters = fast.hoisted_adapter_bytes(deep, 16, ALL_LINEAR, 2) - fast.hoisted_adapter_bytes(
        LLAMA7, 16, ALL_LINEAR, 2)
    eager = replace(FAST7, micro_batch=16)
    assert not graphs_for(eager.real_tokens, eager.lora_dropout, cuda=True)
    for plan, growth in ((eager, 0), (replace(eager, accumulation=2), extra_adapters), (FAST7, extra_adapters)):
        step = estimate_plan(LLAMA7, plan).step_categories
        deeper = estimate_plan(deep, plan).step_categories
        assert deeper["gradients"] == 2 * step["gradients"]
        assert abs(deeper["activations"] - step["activations"] - growth) <= 1, plan


def test_a_graphed_step_peaks_at_its_capture_with_five_cublas_workspaces():
    """The allocator's history of two Trainer rows on the H100 (bench/results/archive/h100_v7_attribution.json)
    peaked in the first step's CUDA-graph capture, before the optimizer had state, holding five 32 MiB
    cuBLAS workspaces: the step's allocated peak is its weights, adapters, gradients and activations
    (one workspace among them) with four more workspaces, and no optimizer state."""
    from studio.core.memory.fast import CAPTURE_WORKSPACES

    for info, plan in ((LLAMA7, FAST7), (SMOL, replace(FAST7, lora_r=8, lora_targets=("q_proj", "v_proj"),
                                                        micro_batch=1, seq_len=4096))):
        assert graphs_for(plan.real_tokens, plan.lora_dropout, cuda=True)
        result = estimate_plan(info, plan)
        c = result.step_categories
        held = c["weights"] + c["lora"] + c["gradients"] + c["activations"]
        step = result.phases["training step"]
        assert step.allocated - held == (CAPTURE_WORKSPACES - 1) * CUBLAS_WORKSPACE_BYTES


def test_a_bf16_base_on_the_fast_path_has_no_dequantization_buffer():
    """engine/fast/weights.py gives a product a shared dequantization buffer only when a base is 4-bit:
    a bf16 base is read where it is, so neither the buffer nor the holes of its size are there."""
    from studio.core.memory.fast import dequant_buffer_bytes, dequantizes

    assert dequantizes("nf4") and not dequantizes("bf16")
    fast = replace(FAST7, lora_targets=("q_proj", "v_proj"), micro_batch=2, seq_len=1024)
    bf16 = replace(fast, weights="bf16")
    nf4, bf16 = estimate_plan(LLAMA7, fast), estimate_plan(LLAMA7, bf16)
    assert nf4.step_categories["activations"] - bf16.step_categories["activations"] == dequant_buffer_bytes(LLAMA7, 2)
    # nor the holes of two dequantized projections' size that the 4-bit step reserves beyond its later steps'
    nf4_gap = nf4.phases["training step"].reserved - nf4.phases["training step"].allocated
    bf16_gap = bf16.phases["training step"].reserved - bf16.phases["training step"].allocated
    assert nf4_gap - bf16_gap > dequant_buffer_bytes(LLAMA7, 2)


def test_a_graphed_steps_capture_reserves_its_pools_free_blocks_too():
    """A graphed step's capture holds no optimizer state but four more cuBLAS workspaces than a later
    step: where the state is the smaller (SmolLM2-135M r8 on q and v: 3.5 MB of it), the capture is
    the peak of reserved memory as well, and its private pool's free blocks and the allocator's fixed
    slack come on top of its allocated peak there (the allocator's history of that row on the H100,
    bench/results/archive/h100_v7_attribution.json: 109 MB reserved beyond allocated at the reserved peak)."""
    from studio.core.memory.fast import FIXED_SLACK, graph_pool_free_bytes

    plan = replace(FAST7, lora_r=8, lora_targets=("q_proj", "v_proj"), micro_batch=1, seq_len=4096)
    result = estimate_plan(SMOL, plan)
    assert result.step_categories["optimizer"] < 4 * CUBLAS_WORKSPACE_BYTES
    step = result.phases["training step"]
    beyond = FIXED_SLACK + graph_pool_free_bytes(SMOL, 4096, 2)
    assert beyond <= step.reserved - step.allocated < beyond + PAGE


def test_adapter_dropout_holds_one_masked_copy_of_the_widest_input():
    """engine/fast/weights.py's AdapterDropout masks the input gradient's product straight into the
    layer's input gradient and frees it before it regenerates the masked input for the adapter's own
    gradient: one ``tokens x fan_in`` copy at a time. On the H100 in one call
    (bench/results/archive/h100_v7_speed_c.json: Llama-2-7B r16 on all projections, 4 x 512 tokens), dropout
    0.05 allocated 0.042 GiB more than none: one 2048 x 11008 bf16 tensor, which the estimate adds."""
    from studio.core.memory.fast import dropout_bytes

    assert dropout_bytes(LLAMA7, 2048, 2, 0.05, ALL_LINEAR) == 2048 * 11008 * 2
    assert dropout_bytes(LLAMA7, 2048, 2, 0.05, ("q_proj", "v_proj")) == 2048 * 4096 * 2
    assert dropout_bytes(LLAMA7, 2048, 2, 0.0, ALL_LINEAR) == 0
    plan = replace(FAST7, generate_new_tokens=64)
    predicted = (estimate_plan(LLAMA7, replace(plan, lora_dropout=0.05)).peak_allocated
                 - estimate_plan(LLAMA7, plan).peak_allocated)
    assert predicted == dropout_bytes(LLAMA7, 2048, 2, 0.05, ALL_LINEAR)
    assert predicted / 2**30 == pytest.approx(0.042, rel=0.1)


def test_a_second_layouts_capture_holds_the_first_graphs_fixed_tensors():
    """make_graphed_callables keeps, for as long as a graph lives, its sample input (the stack's input
    hidden states), cos and sin, its static output and the static gradients of both: unpadded rows of
    varying lengths bring a second layout, whose capture, in a later step, has the first graph's
    beside its own activations and the optimizer's state. Packed rows of the same tokens keep one."""
    from studio.core.memory.fast import graph_tensor_bytes

    assert graph_tensor_bytes(LLAMA7, 4096, 2) == 4096 * (4 * 4096 + 2 * 128) * 2
    unpacked = replace(FAST7, micro_batch=8, packing=False, lengths=(100,) * 40)
    packed = replace(FAST7, micro_batch=8, seq_len=100)
    assert unpacked.data_sized and unpacked.real_tokens == packed.tokens == 800
    one, two = estimate_plan(LLAMA7, packed), estimate_plan(LLAMA7, unpacked)
    state = one.step_categories["optimizer"]
    assert two.phases["training step"].allocated - one.phases["training step"].allocated == pytest.approx(
        state + graph_tensor_bytes(LLAMA7, 800, 2), abs=2**20)
    assert two.phases["training step"].reserved > one.phases["training step"].reserved  # a second private pool
