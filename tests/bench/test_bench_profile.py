"""bench/profile_gpu_bound.py and its trace arithmetic (bench/kernel_trace.py): on hand-made traces,
what issue 13's and issue 39's notes conclude from a profile (where the GPU waits, and on what; which
kernels a step's time goes to) must be computed right; ``--tiny`` runs the whole script for two
families on the CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

from bench.kernel_trace import HOST_COPIES, LOSS, category, idle_by_phase, kernel_table
from bench.profile_gpu_bound import earlier_way, schedule


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_time_between_kernels_goes_to_the_host_phase_running_meanwhile(tmp_path: Path) -> None:
    events = [
        # GPU (microseconds): busy 0-1000 on two overlapping streams, idle 1000-3000, busy 3000-4000,
        # idle 4000-4500, a copy 4500-5000
        _x("kernel", "gemm", 0, 800), _x("kernel", "rope", 500, 500),
        _x("kernel", "gemm", 3000, 1000), _x("gpu_memcpy", "Memcpy HtoD", 4500, 500),
        # host: the figures are read 900-1500, a memory sample 1500-2500; nothing labelled after
        _x("user_annotation", "studio.read_figures", 900, 600),
        _x("user_annotation", "studio.memory_sample", 1500, 1000),
        _x("user_annotation", "other.label", 1000, 3000),  # not one of the Trainer's: ignored
        _x("cpu_op", "aten::mm", 1000, 10),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = idle_by_phase(trace, steps=1)
    assert got["idle_ms_per_step"] == 2.5  # 1000-3000 and 4000-4500
    assert got["idle_by_phase_ms_per_step"] == {"studio.memory_sample": 1.0, "unlabelled": 1.0,
                                                "studio.read_figures": 0.5}
    assert got["largest_gaps_ms"] == [(2.0, "studio.memory_sample"), (0.5, "unlabelled")]
    halved = idle_by_phase(trace, steps=2)
    assert halved["idle_ms_per_step"] == 1.25


def test_repeated_levers_run_interleaved_after_one_warm_up_run_that_is_not_kept() -> None:
    assert schedule(["all", "a", "b"], 2) == [(-1, "all"), (0, "all"), (0, "a"), (0, "b"),
                                              (1, "all"), (1, "a"), (1, "b")]
    assert schedule(["all", "a"], 1) == [(0, "all"), (0, "a")]  # one run each: nothing to warm up for


FUSED, FLASH = "attention: Studio's fused kernels", "attention: flash / SDPA"
GATED = "gated activation: Studio's kernel (SwiGLU or GeGLU, the LoRA update inside)"
GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_badd_coopA_NNT"


def test_a_kernel_goes_to_what_it_computes_by_its_name_or_the_code_that_launched_it() -> None:
    graphed = ("Graphed",)  # a CUDA graph's replay: the names alone tell
    by_name = {
        "attention_forward": FUSED, "attention_delta": FUSED, "attention_backward_dkdv": FUSED,
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x": FLASH,
        "void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": FLASH,
        "_geglu_tanh_forward_kernel": "GELU (GeGLU)", "_geglu_tanh_backward_kernel": "GELU (GeGLU)",
        "_swiglu_fused_gate_up_forward_kernel": "SwiGLU", "_swiglu_fused_gate_up_backward_kernel": "SwiGLU",
        "gated_forward": GATED, "gated_backward": GATED,
        "_rms_norm_forward_kernel": "norms", "rms_norm_backward": "norms", "_triton_rope": "RoPE",
        "nf4_dequantize": "4-bit dequantization", "residual_update": "LoRA update and residual",
        GEMM: "matrix products", "indexSelectLargeIndex": "embedding",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>":
            "elementwise and reductions",
        "liger_cross_entropy_kernel": LOSS, "some_kernel_of_its_own": "other",
    }
    for name, label in by_name.items():
        assert category(name, "kernel", graphed) == label, name
    # the loss' head products are GEMMs: theirs by the code that launched them, eager or labelled
    assert category(GEMM, "kernel", ("bench.loss", "LigerFusedLinearCrossEntropyFunction", "aten::mm")) == LOSS
    assert category(GEMM, "kernel", ("autograd::engine::evaluate_function: TokenLogpsBackward",)) == LOSS
    assert category(GEMM, "kernel", ("HeadCrossEntropy", "aten::mm")) == LOSS
    assert category("cross_entropy_rows", "kernel", ("HeadCrossEntropy",)) == LOSS
    assert category("vectorized_elementwise_kernel<mul>", "kernel", ("bench.embedding", "aten::mul")) == "embedding"
    assert category("multi_tensor_apply_kernel", "kernel", ("Optimizer.step#AdamW.step",)) == "optimizer"
    assert category("aten::mm", "kernel", ("EagerAttention",)) == "attention: plain torch"
    # the innermost code decides: a norm inside the loss range would be the loss's, not the other way
    assert category(GEMM, "kernel", ("Optimizer.step#AdamW.step", "bench.loss")) == LOSS
    assert category("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy") == HOST_COPIES
    assert category("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == HOST_COPIES
    assert category("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "device copies and memsets"
    assert category("Memset (Device)", "gpu_memset") == "device copies and memsets"


def _launch(ts: float, corr: int) -> dict:
    return {**_x("cuda_runtime", "cudaLaunchKernel", ts, 1), "args": {"correlation": corr}}


def _kernel(name: str, ts: float, dur: float, corr: int, stream: int, cat: str = "kernel") -> dict:
    return {**_x(cat, name, ts, dur), "args": {"correlation": corr, "stream": stream}}


def test_the_kernel_table_sums_each_category_and_the_busy_shares_count_overlap_once(tmp_path: Path) -> None:
    events = [
        # the loss, eager: a head product and liger's kernel launched inside the bench's range
        _x("user_annotation", "bench.loss", 0, 100), _x("cpu_op", "LigerFusedLinearCrossEntropyFunction", 1, 98),
        _x("cpu_op", "aten::mm", 2, 5), _launch(3, 1), _launch(50, 2),
        _kernel(GEMM, 10, 40, 1, 7), _kernel("liger_cross_entropy_kernel", 55, 10, 2, 7),
        # a graph's replay: the fused attention and a GEMM on the compute stream, a layer input's copy
        # to the host beside them on a side stream
        _x("cpu_op", "Graphed", 200, 10), {**_launch(205, 3), "name": "cudaGraphLaunch"},
        _kernel("attention_forward", 220, 30, 3, 7), _kernel(GEMM, 250, 50, 3, 7),
        _kernel("Memcpy DtoH (Device -> Pinned)", 230, 100, 3, 9, cat="gpu_memcpy"),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    table = kernel_table(trace, wall_s=400e-6, steps=2)
    assert table["kernels_from"] == "gpu"
    assert table["by_category_ms"] == {HOST_COPIES: 0.1, LOSS: 0.05, "matrix products": 0.05, FUSED: 0.03}
    assert table["by_category_ms_per_step"][HOST_COPIES] == 0.05
    # busy: 10-50, 55-65 and 220-330 (the copy overlaps the attention and the GEMM): 160 of 400 us
    assert table["gpu_busy_ms"] == 0.16 and table["busy_share"] == 0.4
    assert table["compute_stream_busy_share"] == 0.325  # stream 7 alone: 40 + 10 + 30 + 50
    top = {row["name"]: row["category"] for row in table["top_kernels"]}
    assert top[f"{GEMM} @ bench.loss > LigerFusedLinearCrossEntropyFunction > aten::mm"] == LOSS
    assert top[f"{GEMM} @ Graphed"] == "matrix products"


def test_on_the_cpu_the_operators_own_times_stand_for_the_kernels(tmp_path: Path) -> None:
    events = [_x("cpu_op", "aten::linear", 0, 1000), _x("cpu_op", "aten::mm", 100, 600),
              _x("cpu_op", "aten::empty", 120, 50), _x("cpu_op", "aten::gelu", 1000, 300),
              _x("user_annotation", "bench.loss", 2000, 500), _x("cpu_op", "aten::mm", 2050, 400)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    table = kernel_table(trace, wall_s=10e-3, steps=1)
    assert table["kernels_from"] == "cpu ops"
    # the linear's own 400 us and the empty's 50 count apart from the mm's 550 (its 600 less the empty)
    assert table["by_category_ms"] == {"matrix products": 0.55, "elementwise and reductions": 0.45,
                                       LOSS: 0.4, "GELU (GeGLU)": 0.3}
    assert table["gpu_busy_ms"] == 1.7 and table["busy_share"] == 0.17


def test_tiny_profiles_gemma_2_and_its_llama_control_on_the_cpu(tmp_path: Path, studio_env: dict,
                                                                  python: str) -> None:
    """The GPU call's command on the CPU: both families built at a tiny shape, trained, profiled;
    each step's work lands in the categories its family's layer has (Gemma 2's GeGLU, its
    soft-capped attention in plain torch here; Llama's SwiGLU and SDPA) and the loss's range."""
    out = tmp_path / "profile.json"
    command = [python, str(REPO / "bench" / "profile_gpu_bound.py"), "--tiny", "--family", "gemma-2-9b,llama-3-8b",
               "--workloads", "48x2", "--steps", "3", "--levers", "liger_loss", "--models-dir",
               str(tmp_path / "models"), "--out", str(out), "--commit", "abc123"]
    done = subprocess.run(command, cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["commit"] == "abc123" and report["gpu"] == "cpu" and report["tiny"]
    assert set(report["models"]) == {"gemma-2-9b", "llama-3-8b"}
    assert not list(tmp_path.glob("profile_trace_*"))  # the traces are read and removed
    categories = {}
    for name, entry in report["models"].items():
        assert entry["config"]["model_type"] == {"gemma-2-9b": "gemma2", "llama-3-8b": "llama"}[name]
        row = entry["workloads"]["48x2"]
        for lever in ("all", "liger_loss"):
            variant = row["variants"][lever]
            assert variant["tokens_per_s"] > 0 and variant["step_ms"] > 0 and len(variant["losses"]) == 3
            assert variant["fast_path"]["path"] == "fast"
        table = row["profile_2_steps"]
        assert table["kernels_from"] == "cpu ops" and 0 < table["busy_share"] <= 1
        categories[name] = set(table["by_category_ms_per_step"])
        assert {"matrix products", LOSS, "embedding", "optimizer"} <= categories[name], name
    assert {"GELU (GeGLU)", "attention: plain torch"} <= categories["gemma-2-9b"]
    assert not {"SwiGLU", FLASH} & categories["gemma-2-9b"]
    assert {"SwiGLU", FLASH} <= categories["llama-3-8b"]
    assert not {"GELU (GeGLU)", "attention: plain torch"} & categories["llama-3-8b"]


def test_an_earlier_way_of_the_engine_holds_only_while_its_variant_runs(kernel_device) -> None:
    """``--levers liger_loss,liger_geglu``: the loss and GeGLU as they ran before Studio's kernels took
    them, patched in the bench's process for one variant and put back after it."""
    import torch

    pytest.importorskip("triton")  # without it neither kernel runs, with or without a lever
    from studio.engine.fast import cross_entropy, update

    dtype = torch.bfloat16
    assert cross_entropy.available(kernel_device, dtype) and "gelu_pytorch_tanh" in update.ACTIVATIONS
    with earlier_way("liger_loss"):
        assert not cross_entropy.available(kernel_device, dtype)
        assert "gelu_pytorch_tanh" in update.ACTIVATIONS
    with earlier_way("liger_geglu"):
        assert cross_entropy.available(kernel_device, dtype)
        assert update.ACTIVATIONS == ("silu",)
    with earlier_way("no_offload"):  # a settings lever: nothing patched
        assert cross_entropy.available(kernel_device, dtype) and "gelu_pytorch_tanh" in update.ACTIVATIONS
    assert cross_entropy.available(kernel_device, dtype) and "gelu_pytorch_tanh" in update.ACTIVATIONS
