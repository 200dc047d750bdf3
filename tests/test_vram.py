"""The VRAM estimator against hand-computed values and the H100 reference measurements."""

from __future__ import annotations

import contextlib
import json
import math
import random
import subprocess
import sys
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest

from bench.rescore_vram import main as rescore_main
from studio.core.cli_estimate import main as estimate_main
from studio.core.config import RunConfig, parse_config
from studio.core.gpus import GB, gpu_for_size
from studio.core.model_info import KNOWN_MODELS, ModelInfoError, from_config_dict, load_model_info
from studio.core.plan import graphs_for
from studio.core.vram import (
    ALL_LINEAR,
    CATEGORIES,
    INT8_THRESHOLD,
    Plan,
    _small_pool_trainable,
    _swiglu_tail,
    _workspace_pins_loss_expandable,
    estimate,
    estimate_plan,
    expandable_segments_from_env,
    int8_outlier_fractions,
    lora_params,
    plan_for,
    walkthrough,
    weight_bytes,
)

REPO = Path(__file__).resolve().parents[1]
LLAMA7 = KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]
SMOL = KNOWN_MODELS["HuggingFaceTB/SmolLM2-135M"]
# The reference QLoRA loop on one H100 (docs: /work/shared/GPU.md): NF4 double quant, bf16 compute,
# LoRA r16 on all 7 projections, AdamW; PyTorch's default allocator (fixed segments), as measured;
# transformers' own loss from labels (the Trainer's keeps less: test_the_trainers_loss_...).
QLORA7 = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, expandable_segments=False,
              loss="hf")


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


@pytest.mark.parametrize("micro_batch,seq,checkpointing,allocated,reserved", [
    (1, 512, True, 5.79, 6.34),
    (4, 512, True, 7.29, 8.57),
    (1, 2048, True, 7.29, 8.57),
    (4, 512, False, 26.23, 27.86),
])
def test_peaks_match_the_h100_reference_runs(micro_batch, seq, checkpointing, allocated, reserved):
    plan = replace(QLORA7, micro_batch=micro_batch, seq_len=seq, checkpointing=checkpointing)
    step = estimate_plan(LLAMA7, plan).phases["training step"]  # the loop measured training steps only
    assert step.allocated / GB == pytest.approx(allocated, rel=0.05)
    assert step.reserved / GB == pytest.approx(reserved, rel=0.05)


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
    # ~10.3 MB a token without checkpointing on the H100
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
    code = ("import sys, studio.core.vram, studio.core.cli_estimate, studio.core.gpus; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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
    # H100, bitsandbytes 0.50.2, random weights: 13.63 GB peak allocated
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
    assert _swiglu_tail(sigma, INT8_THRESHOLD) == pytest.approx(hits / n, rel=0.15)


def test_reserved_at_the_loss_holds_an_extra_fp32_logits_block():
    # SmolLM2's 49k vocabulary makes the loss the peak: reserved - allocated exceeds one fp32 logits
    # block (4 bytes x tokens x vocab); measured on the H100: 6.06 GB reserved, 4.98 GB allocated
    plan = replace(INT8_QLORA, micro_batch=8)
    result = estimate_plan(SMOL, plan)
    assert result.peak_reserved - result.peak_allocated > 4 * 4096 * 49152
    assert result.peak_reserved / GB == pytest.approx(6.06, rel=0.05)


def test_loss_blocks_are_reused_when_the_forward_leaves_a_block_for_the_workspace():
    # SmolLM2 nf4 ckpt, 8 x 1024 tokens: each checkpointed layer frees its 48 MiB fp32 gate/up
    # outputs, the backward thread's 32 MiB cuBLAS workspace goes there, and the next step's loss gets
    # the cached logits blocks back: measured on the H100, 6.979 GB reserved, 6.574 GB allocated
    plan = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.05, micro_batch=8,
                seq_len=1024, checkpointing=True, expandable_segments=False, loss="hf")
    result = estimate_plan(SMOL, plan)
    assert result.peak_reserved - result.peak_allocated < 4 * 8192 * 49152
    assert result.peak_reserved / GB == pytest.approx(6.979, rel=0.05)
    # 8 x 512 tokens: the freed gate/up blocks are 24 MiB, too small: the workspace pins a logits block
    half = estimate_plan(SMOL, replace(plan, seq_len=512))
    assert half.peak_reserved - half.peak_allocated > 4 * 4096 * 49152


def test_expandable_segments_add_the_small_pool_peak_that_comes_later():
    # Llama-2-7B QLoRA r16: every LoRA matrix is under 1 MiB, so the adapters, their gradients and
    # AdamW's foreach temporary live in the small pool, which peaks at the optimizer step; the overall
    # allocated peak is at the loss, before any gradient exists. Reserved is the sum of the two pools'
    # high-water marks: allocated + gradients + temporary (2 x 4 bytes x 39.98M), in mapping steps.
    # Traced on the H100: 7.812 GB reserved, 7.225 allocated, 0.319 GB of it this pool timing.
    plan = replace(QLORA7, micro_batch=4, seq_len=512)
    fixed = estimate_plan(LLAMA7, plan)
    grown = estimate_plan(LLAMA7, replace(plan, expandable_segments=True))
    assert grown.peak_allocated == fixed.peak_allocated
    lora = lora_params(LLAMA7, 16, ALL_LINEAR)
    gap = grown.peak_reserved - grown.peak_allocated
    assert 2 * 4 * lora <= gap <= 2 * 4 * lora + 20 * 2**20 + 4 * 2**20
    assert grown.peak_reserved < fixed.peak_reserved  # freed blocks merge: less slack than segments
    assert grown.peak_reserved / GB == pytest.approx(7.812, rel=0.05)


def test_expandable_small_pool_takes_only_tensors_up_to_one_mib():
    # r64: a 64 x 4096 fp32 matrix is exactly 1 MiB (small pool); 64 x 11008 ones go to the large
    # pool, so only 352 MiB of the 610 MiB of adapters add their gradient and temporary to the gap
    plan = replace(QLORA7, lora_r=64, micro_batch=2, seq_len=4096, lora_dropout=0.05, expandable_segments=True)
    assert _small_pool_trainable(LLAMA7, plan) == 32 * 64 * (8 * 4096 + 2 * 4096 + 4096)
    result = estimate_plan(LLAMA7, plan)
    assert result.peak_reserved / GB == pytest.approx(16.070, rel=0.05)  # measured on the H100


def test_expandable_workspace_in_the_logits_range_shifts_the_next_loss():
    # SmolLM2 nf4 ckpt, 8 x 1024 tokens: the forward leaves no hole of 32 MiB in the one segment (the
    # saved hidden states are carved out of the freed working sets), so the backward's cuBLAS workspace
    # settles right after the freed bf16 logits and every later loss starts one bf16 logits block
    # further on. H100 trace: step 1 reserved 6.635 GB, steps 2-3 7.474; 6.574 GB allocated.
    plan = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.05, micro_batch=8,
                seq_len=1024, checkpointing=True, expandable_segments=True, loss="hf")
    assert _workspace_pins_loss_expandable(SMOL, plan)
    result = estimate_plan(SMOL, plan)
    assert result.peak_reserved - result.peak_allocated > 2 * 8192 * 49152
    assert result.peak_reserved / GB == pytest.approx(7.474, rel=0.05)
    # Llama-2-7B at 2048 tokens: three freed 4096-wide bf16 tensors make a 48 MiB hole; no shift
    llama = replace(QLORA7, micro_batch=4, seq_len=512, expandable_segments=True)
    assert not _workspace_pins_loss_expandable(LLAMA7, llama)


def test_a_pinned_workspace_shifts_the_trainers_loss_by_the_workspace_only():
    # The Trainer's loss drops its bf16 logits at the end of the forward, so the backward's workspace
    # lands at the start of the freed range: the next loss moves by the workspace, not by a bf16
    # logits block as under transformers' loss (whose shift the HF loop's H100 trace showed).
    # SmolLM2 int8 r16 seq512 mb8 through the Trainer on the H100: 4.215 GiB allocated, 4.359 reserved.
    from studio.core.vram import CUBLAS_WORKSPACE_BYTES, _pinned_loss_shift

    trainer = Plan(weights="int8", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=8,
                   seq_len=512, checkpointing=True, expandable_segments=True, loss="trainer")
    hf = replace(trainer, loss="hf")
    assert _workspace_pins_loss_expandable(SMOL, trainer)
    assert _pinned_loss_shift(SMOL, trainer) == CUBLAS_WORKSPACE_BYTES
    assert _pinned_loss_shift(SMOL, hf) == 4096 * SMOL.vocab * 2 + CUBLAS_WORKSPACE_BYTES
    result = estimate_plan(SMOL, trainer)
    assert result.peak_reserved - result.peak_allocated < 4096 * SMOL.vocab * 2  # under one bf16 logits block
    assert result.peak_reserved / 2**30 == pytest.approx(4.359, rel=0.03)
    assert result.peak_allocated / 2**30 == pytest.approx(4.215, rel=0.03)


def test_workspace_rules_match_every_h100_allocator_trace():
    # bench/results/traces: where the backward's cuBLAS workspace actually landed on the H100. It
    # pinned the loss's range when the hole or segment it took can hold an fp32 logits block.
    from bench.trace_pools import load, workspaces
    from bench.vram_accuracy import ARCHS, Case
    from studio.core.model_info import from_config_dict
    from studio.core.vram import _loss_blocks_pinned

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    seen = 0
    for name in ("vram_accuracy_h100_v3.json", "vram_accuracy_h100_v3_expandable.json"):
        for row in json.loads((results / name).read_text())["rows"]:
            trace = row.get("measured", {}).get("trace")
            if not trace:
                continue
            case = Case(**{**row["case"], "targets": tuple(row["case"]["targets"])})
            info, plan = from_config_dict(dict(ARCHS[case.arch]), case.arch), case.plan()
            _, landed_in, _ = workspaces(load(results / "traces" / trace))[-1]
            pinned = landed_in >= plan.tokens * info.vocab * 4
            rule = _workspace_pins_loss_expandable if plan.expandable_segments else _loss_blocks_pinned
            assert rule(info, plan) is pinned, row["label"]
            seen += 1
    assert seen == 20  # 18 expandable rows, 2 default ones


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


@pytest.mark.parametrize("name,prefix", [
    ("vram_accuracy_h100_v3.json", ""),  # PyTorch's default allocator: the grid as the issue asks
    ("vram_accuracy_h100_v3_expandable.json", "expandable_"),  # what Studio's engine runs with
])
def test_rescored_h100_results_meet_the_goal(tmp_path, capsys, name, prefix):
    out = tmp_path / "rescored.json"
    results = Path(__file__).resolve().parents[1] / "bench" / "results" / name
    assert rescore_main(["--results", str(results), "--out", str(out)]) == 0
    assert "median |error|" in capsys.readouterr().out
    summary = json.loads(out.read_text())["summary"]
    for key in ("peak_allocated", "peak_reserved"):
        assert summary[prefix + key]["n"] == 18
        assert summary[prefix + key]["median_abs_error"] < 0.05
        assert summary[prefix + key]["worst_abs_error"] < 0.10


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


SEQUENTIAL_TRAINER_RESULTS = ("h100_speed_memory_v2.json", "h100_speed_memory_v2_fixed.json",
                              "h100_vram_trainer_v2_oos_sequential.json")
"""Studio's Trainer on the H100 with the shared dequantization buffer and host-held layer inputs,
one row at a time (the v2 grid's parallel rows are not used for reserved memory: docs/memory.md)."""


@contextlib.contextmanager
def _offload_rule(rule):
    """The estimator with another engine's host-offload rule (core/plan.offload_for), for rows
    measured on that engine."""
    import studio.core.plan as core_plan
    import studio.core.vram_fast as vram_fast

    saved = vram_fast.offload_for, core_plan.offload_for
    vram_fast.offload_for = core_plan.offload_for = rule
    try:
        yield
    finally:
        vram_fast.offload_for, core_plan.offload_for = saved


@contextlib.contextmanager
def _fused_buffer_rule():
    """The estimator with the engine that dequantized a fused pair at once (gate and up into one
    buffer), for rows measured before the products ran one projection at a time."""
    import studio.core.vram_fast as vram_fast

    saved = vram_fast.dequant_buffer_bytes
    vram_fast.dequant_buffer_bytes = vram_fast.widest_fused_weight
    try:
        yield
    finally:
        vram_fast.dequant_buffer_bytes = saved


def _trainer_rows(names):
    """(case, prediction, measurement) of each full-length Trainer row in ``names`` (padded short
    rows aside: the estimate assumes full-length rows, docs/memory.md)."""
    import bench.vram_accuracy as bench

    out = []
    for name in names:
        for row in json.loads((REPO / "bench/results" / name).read_text())["rows"]:
            c = row["case"]
            if c.get("engine") != "trainer" or c.get("lever") not in ("", "all") \
                    or "peak_reserved" not in row.get("measured", {}) or c.get("data", "long") != "long":
                continue
            case = bench.Case(**{**c, "targets": tuple(c["targets"]), "lever": ""})
            if case.dropout and "CUDA graphs" not in row["measured"].get("fast_path", "CUDA graphs"):
                continue  # measured before adapter dropout kept the graphs: another engine's step
            info = from_config_dict(dict(bench.ARCHS[case.arch]), case.arch)
            rule = contextlib.nullcontext()
            if "on eager steps" in row["measured"].get("fast_path", ""):
                # measured before the graphed steps kept their layer inputs on the host too: scored
                # with the rule that engine followed
                rule = _offload_rule(lambda tokens, dropout, cuda: cuda and not graphs_for(tokens, dropout, cuda))
            fused = contextlib.nullcontext()
            if "one projection at a time" not in row["measured"].get("fast_path", ""):
                fused = _fused_buffer_rule()
            plan = case.plan()
            if "recomputation without the last product" not in row["measured"].get("fast_path", ""):
                plan = replace(plan, fused_layer=False)  # the layer of the engine before 09fac3a
            if "q/k/v kept on the host" not in row["measured"].get("fast_path", ""):
                plan = replace(plan, kept_qkv=False)  # measured before q, k and v waited on the host
            if "attention kept on the host" not in row["measured"].get("fast_path", ""):
                plan = replace(plan, keep_attention_from=None)  # measured before the attention waited there
            with rule, fused:
                predicted = bench.predicted_peaks(estimate_plan(info, plan), case.phases(row["measured"]))
            out.append((case, predicted, row["measured"]))
    return out


def test_fast_path_model_against_the_trainer_on_the_h100():
    """The fast path's model against Studio's Trainer on the H100 (Llama-2-7B and Llama-3-8B shapes,
    512-8192 tokens a micro-batch, graphs and eager steps, dropout), the peak over the whole run
    (training, final evaluation, adapter save). In sample: within 3% median and 5% worst, reserved
    and allocated; the rows marked out of sample when the grid was committed: within 3%."""
    import statistics

    import bench.vram_accuracy as bench

    rows = _trainer_rows(SEQUENTIAL_TRAINER_RESULTS)
    assert len(rows) >= 12
    errors: dict[bool, list[float]] = {True: [], False: []}
    for case, predicted, measured in rows:
        assert case.plan().path == measured["path"] == "fast", case.label
        in_sample = not case.out_of_sample or case.label in bench.FITTED
        for key in ("peak_allocated", "peak_reserved"):
            error = abs(predicted[key] / measured[key] - 1)
            errors[in_sample].append(error)
            assert error < (0.05 if in_sample else 0.03), (case.label, key, error)
    assert statistics.median(errors[True]) < 0.03
    assert len(errors[False]) >= 6  # three out-of-sample configs, both peaks


def _meets_the_bar(rows, worst=0.07):
    """Issue 18's bar: medians within 3%, over all rows and over the rows marked out of sample when
    the grid was committed, and every row within ``worst``, peak allocated and peak reserved alike."""
    import statistics

    for chosen in (rows, [r for r in rows if not r["in_sample"]]):
        for key in ("error_peak_allocated", "error_peak_reserved"):
            assert statistics.median(abs(r[key]) for r in chosen) <= 0.03, key
    for row in rows:
        for key in ("error_peak_allocated", "error_peak_reserved"):
            assert abs(row[key]) <= worst, (row["label"], key, row[key])


def test_the_estimator_against_the_v5_grid_the_engine_that_runs_now():
    """Issue 18's grid (25 rows: SmolLM2-135M, Llama-2-7B and Llama-3-8B shapes, seq 256-4096,
    micro-batch 1-16, checkpointing on and off, r8-64 on q/v and all projections, NF4 / 8-bit / bf16,
    long, packed and padded short rows) through Studio's Trainer on the H100 on the engine of 09fac3a
    (bench/results/h100_vram_trainer_v5_*.json: the recomputation without down, the products writing
    onto the residual stream, q/k/v apart), the peak over the whole run, scored with the estimator as
    it stands (bench/refit_vram_fast.py). Issue 18's bar over all rows and the 8 out of sample; every
    long-row fast-path row of the 7B and 8B shapes within 5% reserved. Before the layer of that engine
    went into the model, reserved was 4.9% median and 10.3% worst, over-predicted on every fast row."""
    from bench.refit_vram_fast import scored_rows

    rows = [r for name in ("h100_vram_trainer_v5_a.json", "h100_vram_trainer_v5_b.json")
            for r in scored_rows(json.loads((REPO / "bench/results" / name).read_text()))]
    assert len(rows) == 25 and sum(not r["in_sample"] for r in rows) == 8
    _meets_the_bar(rows)
    # Five rows added after that refit, committed with their predictions before they ran
    # (h100_vram_trainer_v6_predicted.json, then _v6_oos.json): 13 of 30 out of sample.
    later = scored_rows(json.loads((REPO / "bench/results/h100_vram_trainer_v6_oos.json").read_text()))
    assert len(later) == 5 and not any(r["in_sample"] for r in later)
    _meets_the_bar(later)
    _meets_the_bar(rows + later)
    for row in rows:
        if row["path"] == "fast" and row["case"]["arch"] != "smollm2-135m" and row["case"]["data"] == "long":
            assert abs(row["error_peak_reserved"]) <= 0.05, (row["label"], row["error_peak_reserved"])


def test_the_committed_scores_are_the_estimators_own():
    """bench/results/h100_vram_trainer_v5_v6_scored.json (issue 18's summary keys over the 30 rows,
    13 out of sample) is what the estimator as committed gives: a change to the model must rewrite it
    (bench/refit_vram_fast.py ... --write)."""
    from bench.refit_vram_fast import scored_rows
    from bench.vram_accuracy import summarize

    scored = json.loads((REPO / "bench/results/h100_vram_trainer_v5_v6_scored.json").read_text())
    rows = [r for name in scored["sources"] for r in scored_rows(json.loads((REPO / name).read_text()))]
    assert summarize(rows) == {k: v for k, v in scored["summary"].items() if k.startswith("peak_")}
    assert scored["summary"]["out_of_sample_rows"] == 13 and all(r.get("path") for r in scored["rows"])
    for key in ("peak_allocated", "peak_reserved"):
        for part in (scored["summary"], scored["summary"]["out_of_sample"]):
            assert part[key]["median_abs_error"] <= 0.03 and part[key]["worst_abs_error"] <= 0.07


def test_the_v5_rows_were_scored_with_the_new_engines_layer_and_v3_with_the_old():
    """The rescoring tells the engines apart by what the run said it did ("recomputation without the
    last product"): the v5 rows get the current layer and constants, the v3 and v4 rows (history: the
    engine before 09fac3a) the layer and constants fitted to that one (core/vram_fast.py's UNFUSED),
    under which they still score as they did (medians within 3%, every row within 7%). The current
    layer's outputs are smaller by RoPE's q and k copies, one residual-sized tensor and the skipped
    down projection's output; eager steps keep no offload holes on it."""
    from bench.refit_vram_fast import scored_rows
    from studio.core import vram_fast

    h, i = 4096, 11008
    assert vram_fast.layer_outputs_per_token(LLAMA7, 2, fused=False) \
        - vram_fast.layer_outputs_per_token(LLAMA7, 2) == 2 * (2 * h + h + h)
    assert vram_fast.layer_outputs_per_token(LLAMA7, 2) == 2 * (2 * h + 3 * h + h + h + 3 * i)
    assert vram_fast.constants(True)[2] == 0 and vram_fast.constants(False) == (1.0, 1.0, 3)
    eager = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=16, seq_len=512,
                 path="fast")
    new, old = estimate_plan(LLAMA7, eager), estimate_plan(LLAMA7, replace(eager, fused_layer=False))
    assert new.peak_reserved < old.peak_reserved and new.peak_allocated < old.peak_allocated
    history = scored_rows(json.loads((REPO / "bench/results/h100_vram_trainer_v3.json").read_text()))
    assert len(history) == 25
    _meets_the_bar(history)
    again = [r for name in ("h100_vram_trainer_v4_a.json", "h100_vram_trainer_v4_b.json")
             for r in scored_rows(json.loads((REPO / "bench/results" / name).read_text()))]
    assert len(again) == 10
    _meets_the_bar(again)


def test_the_kv_cache_decision_matches_where_every_v5_row_kept_it():
    """core/vram_phases.py decides where the answer's KV cache lives, and the session asks it: on the
    v5 grid (H100, engine of 09fac3a) and the five later rows every row kept it where the estimate,
    with the refitted step, says (14 of 30 on the host), and no phase after training reserved more
    than the step."""
    from bench.vram_accuracy import ARCHS, Case

    rows = [r for name in ("h100_vram_trainer_v5_a.json", "h100_vram_trainer_v5_b.json",
                           "h100_vram_trainer_v6_oos.json")
            for r in json.loads((REPO / "bench/results" / name).read_text())["rows"]]
    host = 0
    for row in rows:
        m = row["measured"]
        assert m["run_peak_reserved"] <= m["train_peak_reserved"], row["label"]
        assert m["generate_peak_reserved"] <= m["train_peak_reserved"], row["label"]
        case = Case(**{**row["case"], "targets": tuple(row["case"]["targets"])})
        info = from_config_dict(dict(ARCHS[case.arch]), case.arch)
        plan = case.plan()
        if case.data == "short" and m.get("longest_examples"):
            plan = replace(plan, lengths=tuple(m["longest_examples"]))
        plan = replace(plan, generate_prompt_tokens=m["generate_prompt_tokens"])
        on_host = estimate_plan(info, plan).phases["generation"].host_kv
        assert on_host is (m["generate_kv_cache"] == "host"), row["label"]
        host += on_host
    assert host == 14


def test_no_phase_reserves_more_than_the_training_step_on_the_h100():
    """Issue 18: evaluation and generation never need more memory than the training step. The nine
    v3 rows whose chat answer (a prompt as long as a training row) reserved more than the step, and
    one 8-bit SmolLM2 row, run again through the Trainer on the H100 after the answer's prompt went
    through in pieces with its
    KV cache on the host where the estimate says it could exceed the step
    (bench/results/h100_vram_trainer_v4_*.json): every phase of every row stays within its training
    step's peak reserved memory, and where the KV cache lived is the estimate's decision (the
    session asks the same function)."""
    from dataclasses import replace

    from bench.vram_accuracy import ARCHS, Case

    results = REPO / "bench" / "results"
    before = {r["label"]: r["measured"] for r in
              json.loads((results / "h100_vram_trainer_v3.json").read_text())["rows"]}
    rows = [r for name in ("h100_vram_trainer_v4_a.json", "h100_vram_trainer_v4_b.json")
            for r in json.loads((results / name).read_text())["rows"] if "measured" in r]
    assert len(rows) == 10
    exceeded = 0
    for row in rows:
        m = row["measured"]
        assert m["generate_peak_reserved"] <= m["train_peak_reserved"], row["label"]
        assert m["run_peak_reserved"] <= m["train_peak_reserved"], row["label"]  # final evaluation, save
        old = before[row["label"]]
        exceeded += old["generate_peak_reserved"] > old["train_peak_reserved"]
        case = Case(**{**row["case"], "targets": tuple(row["case"]["targets"])})
        info = from_config_dict(dict(ARCHS[case.arch]), case.arch)
        plan = replace(case.plan(), generate_prompt_tokens=m["generate_prompt_tokens"])
        assert estimate_plan(info, plan).phases["generation"].host_kv is (m["generate_kv_cache"] == "host")
    assert exceeded == 9  # the tenth (SmolLM2 8-bit) never did: its answer stays on the card


def test_a_graphed_step_peaks_at_its_capture_with_five_cublas_workspaces():
    """bench/results/h100_v7_attribution.json: the allocator's history of two Trainer rows on the H100
    replayed at their allocated peak. Both peaked in the first step's CUDA-graph capture, before the
    optimizer had state, holding five 32 MiB cuBLAS workspaces (counted on the SmolLM2 row, whose
    activations are far smaller than a workspace); the fast path's model says both, and puts both
    rows within 6% allocated (they had been -36% and +15%; the SmolLM2 row's recomputed layer holds
    some 16 MB more than the working set the model fits across shapes: -5.0%)."""
    from bench.refit_vram_fast import scored_rows
    from studio.core.vram_fast import CAPTURE_WORKSPACES

    results = json.loads((REPO / "bench/results/h100_v7_attribution.json").read_text())
    traced = {r["label"]: r["measured"]["attribution"] for r in results["rows"]}
    for label, attribution in traced.items():
        assert not any("torch/optim" in e["where"] for e in attribution["at_peak"]), label
    smol = next(a for label, a in traced.items() if label.startswith("smollm2"))
    workspaces = sum(e["blocks"] for e in smol["at_peak"] if e["bytes"] == 32 * 2**20 * e["blocks"])
    assert workspaces == CAPTURE_WORKSPACES
    rows = scored_rows(results)
    assert len(rows) == 2
    for row in rows:
        assert abs(row["error_peak_allocated"]) <= 0.06, (row["label"], row["error_peak_allocated"])
        assert abs(row["error_peak_reserved"]) <= 0.06, (row["label"], row["error_peak_reserved"])


def test_a_bf16_base_on_the_fast_path_has_no_dequantization_buffer():
    """engine/fast/weights.py gives a product a shared dequantization buffer only when a base is 4-bit:
    a bf16 base is read where it is, so neither the buffer nor the holes of its size are there (the
    Llama-2-7B bf16 r16 q/v row through the Trainer on the H100, bench/results/h100_vram_trainer_v4_b.json:
    13.235 GiB allocated, 13.322 reserved; with the buffer counted, 13.246 and 13.729; on the engine
    of 09fac3a, bench/results/h100_vram_trainer_v5_a.json: 13.188 and 13.283)."""
    from studio.core.vram_fast import dequant_buffer_bytes, dequantizes

    assert dequantizes("nf4") and not dequantizes("bf16")
    fast = Plan(weights="nf4", lora_r=16, lora_targets=("q_proj", "v_proj"), lora_dropout=0.0, micro_batch=2,
                seq_len=1024, path="fast")
    bf16 = replace(fast, weights="bf16")
    nf4_step, bf16_step = estimate_plan(LLAMA7, fast).step_categories, estimate_plan(LLAMA7, bf16).step_categories
    assert nf4_step["activations"] - bf16_step["activations"] == dequant_buffer_bytes(LLAMA7, 2)
    result = estimate_plan(LLAMA7, bf16)
    assert result.peak_allocated / 2**30 == pytest.approx(13.188, rel=0.02)
    assert result.peak_reserved / 2**30 == pytest.approx(13.283, rel=0.02)
    before = estimate_plan(LLAMA7, replace(bf16, fused_layer=False))
    assert before.peak_allocated / 2**30 == pytest.approx(13.235, rel=0.02)
    assert before.peak_reserved / 2**30 == pytest.approx(13.322, rel=0.02)


def test_a_graphed_steps_capture_reserves_its_pools_free_blocks_too():
    """A graphed step's capture holds no optimizer state but four more cuBLAS workspaces than a later
    step: where the state is the smaller (SmolLM2-135M r8 on q and v: 3.5 MB of it), the capture is
    the peak of reserved memory as well, and its private pool's free blocks and the allocator's fixed
    slack come on top of its allocated peak there. The allocator's history of that row on the H100
    (bench/results/h100_v7_attribution.json): 109 MB reserved beyond allocated at the reserved peak;
    the v4 run of the same row reserved 0.4707 GiB (the estimate said 0.369, its allocated peak, before)."""
    from bench.vram_accuracy import ARCHS, Case

    results = json.loads((REPO / "bench/results/h100_v7_attribution.json").read_text())
    row = next(r for r in results["rows"] if r["label"].startswith("smollm2"))
    case = Case(**{**row["case"], "targets": tuple(row["case"]["targets"])})
    info = from_config_dict(dict(ARCHS[case.arch]), case.arch)
    plan = replace(case.plan(), fused_layer=False)  # traced on the engine before 09fac3a
    assert graphs_for(plan.real_tokens, plan.lora_dropout, cuda=True)
    step = estimate_plan(info, plan).phases["training step"]
    beyond = row["measured"]["attribution"]["reserved_minus_allocated_at_reserved_peak"]
    assert step.reserved - step.allocated == pytest.approx(beyond, rel=0.1)
    assert step.reserved == pytest.approx(row["measured"]["train_peak_reserved"], rel=0.03)


def test_adapter_dropout_holds_one_masked_copy_of_the_widest_input():
    """engine/fast/weights.py's AdapterDropout masks the input gradient's product straight into the
    layer's input gradient and frees it before it regenerates the masked input for the adapter's own
    gradient: one ``tokens x fan_in`` copy at a time. On the H100 in one call
    (bench/results/h100_v7_speed_c.json: Llama-2-7B r16 on all projections, 4 x 512 tokens), dropout
    0.05 allocated 0.042 GiB more than none: one 2048 x 11008 bf16 tensor, which the estimate adds."""
    from studio.core.vram_fast import dropout_bytes

    assert dropout_bytes(LLAMA7, 2048, 2, 0.05, ALL_LINEAR) == 2048 * 11008 * 2
    assert dropout_bytes(LLAMA7, 2048, 2, 0.05, ("q_proj", "v_proj")) == 2048 * 4096 * 2
    assert dropout_bytes(LLAMA7, 2048, 2, 0.0, ALL_LINEAR) == 0
    rows = {r["case"]["dropout"]: r["measured"] for r in
            json.loads((REPO / "bench/results/h100_v7_speed_c.json").read_text())["rows"]
            if r["case"]["engine"] == "trainer" and r["case"]["data"] == "long"}
    plan = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=4, seq_len=512,
                path="fast", generate_new_tokens=64)
    measured = rows[0.05]["peak_allocated"] - rows[0.0]["peak_allocated"]
    predicted = (estimate_plan(LLAMA7, replace(plan, lora_dropout=0.05)).peak_allocated
                 - estimate_plan(LLAMA7, plan).peak_allocated)
    assert predicted == pytest.approx(measured, rel=0.1)


def test_a_second_layouts_capture_holds_the_first_graphs_fixed_tensors():
    """make_graphed_callables keeps, for as long as a graph lives, its sample input (the stack's input
    hidden states), cos and sin, its static output and the static gradients of both: a second
    layout's capture, in a later step, has the first graph's beside its own activations and the
    optimizer's state. The packed Llama-2-7B row of the v3 grid, whose engine captured two layouts
    (bench/results/h100_vram_trainer_v3.json), comes within 5% allocated with them (-7.0% without)."""
    from bench.refit_vram_fast import scored_rows
    from studio.core.vram_fast import graph_tensor_bytes

    assert graph_tensor_bytes(LLAMA7, 4096, 2) == 4096 * (4 * 4096 + 2 * 128) * 2
    lengths = (100,) * 40
    one = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=8, seq_len=512,
               path="fast", lengths=lengths)
    two = replace(one, packed_layouts=2)
    state = estimate_plan(LLAMA7, one).step_categories["optimizer"]
    step_one = estimate_plan(LLAMA7, one).phases["training step"]
    step_two = estimate_plan(LLAMA7, two).phases["training step"]
    assert step_two.allocated - step_one.allocated == pytest.approx(state + graph_tensor_bytes(LLAMA7, 4096, 2),
                                                                    abs=2**20)
    rows = scored_rows(json.loads((REPO / "bench/results/h100_vram_trainer_v3.json").read_text()))
    packed = next(r for r in rows if r["label"].startswith("llama2-7b") and r["label"].endswith("short-packed"))
    assert abs(packed["error_peak_allocated"]) <= 0.05, packed["error_peak_allocated"]
