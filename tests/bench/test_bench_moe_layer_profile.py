"""bench/moe_layer_profile.py and bench/moe_phases.py on the CPU (issue 42): a profiled kernel lands in the
pass and phase of the engine code that launched it, the traffic model and the ideal the GPU result is
read against are the arithmetic they claim, the instrumentation changes nothing the engine computes,
and ``--tiny`` runs the whole pipeline (NF4 and MXFP4 experts, with and without expert adapters,
transformers' block beside it) into a JSON that says what a GPU result must."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO

from bench.moe_layer_profile import build, run_block, storage_for
from bench.moe_phases import EVALUATE, Dims, attribute, ideal, pass_of, phase_of, phase_ranges, region_of, traffic


def _where(stack: list[str], region: str | None = None) -> tuple[str, str]:
    where = pass_of(stack)
    return where, phase_of(stack, region) if where != "outside" else "other"


def test_each_kernel_lands_in_the_pass_and_phase_of_the_engine_code_that_launched_it() -> None:
    block = ["moe.block"]
    first_node = ["IndexAddBackward0", EVALUATE + "IndexAddBackward0"]  # the recomputation runs inside it
    # the forward's inline code, placed by where it runs against the products
    assert _where(["aten::sort", "moe.sort", *block], "dispatch") == ("forward", "sort")
    assert _where(["aten::scatter_add_", *block], "dispatch") == ("forward", "sort")
    assert _where(["aten::index", *block], "dispatch") == ("forward", "permute")
    assert _where(["aten::index_select", "Gather", *block], "dispatch") == ("forward", "permute")
    assert _where(["aten::scatter_", *block], "dispatch") == ("forward", "sort")
    assert _where(["aten::mul", *block], "between") == ("forward", "activation")
    assert _where(["aten::index_add_", *block], "combine") == ("forward", "combine")
    # the engine's methods, wrapped in ranges
    projection = ["ExpertProduct", *block]
    assert _where(["nf4_dequantize", "moe.dequant", "moe.gate_up", *projection]) == ("forward", "dequant.gate_up")
    assert _where(["aten::_grouped_mm", "moe.mm.base", "moe.down", *projection]) == ("forward", "products.down")
    assert _where(["aten::_grouped_mm", "moe.mm.lora", "moe.down", *projection]) == ("forward", "lora.down")
    assert _where(["aten::add_", "moe.gate_up", *projection]) == ("forward", "lora.gate_up")
    assert _where(["aten::transpose", "moe.gate_up", *projection]) == ("forward", "products.gate_up")
    assert _where(["aten::clone", "moe.adapters"]) == ("forward", "adapters")
    # the same code recomputed for the backward
    assert _where(["aten::topk", "moe.route", *block, *first_node]) == ("recompute", "router")
    assert _where(["aten::index", *block, *first_node], "dispatch") == ("recompute", "permute")
    # the backward: the engine's ranges first, else the autograd node
    assert _where(["aten::index_select", *first_node]) == ("backward", "combine")
    assert _where(["aten::_index_put_impl_", "IndexBackward0", EVALUATE + "IndexBackward0"]) == ("backward", "permute")
    assert _where(["GatherBackward", EVALUATE + "GatherBackward"]) == ("backward", "permute")
    assert _where(["aten::index_select", "CombineBackward", EVALUATE + "CombineBackward"]) == ("backward", "combine")
    assert _where(["aten::_grouped_mm", "moe.mm.base", "moe.gate_up", "ExpertProductBackward",
                   EVALUATE + "ExpertProductBackward"]) == ("backward", "products.gate_up")
    assert _where(["aten::silu_backward", "SiluBackward0", EVALUATE + "SiluBackward0"]) == ("backward", "activation")
    assert _where(["aten::mm", "MmBackward0", EVALUATE + "MmBackward0"]) == ("backward", "router")
    assert _where(["detach", EVALUATE + "torch::autograd::AccumulateGrad"]) == ("backward", "other")
    assert _where(["aten::randn"]) == ("outside", "other")
    # before gate/up's range, after down's, or between
    assert region_of(1.0, (2.0, 3.0), (4.0, 5.0)) == "dispatch"
    assert region_of(3.5, (2.0, 3.0), (4.0, 5.0)) == "between"
    assert region_of(5.0, (2.0, 3.0), (4.0, 5.0)) == "combine"


def _event(name: str, start: float, end: float, parent=None, kernels=(), device: str = "CPU", annotation=None):
    from torch.autograd import DeviceType

    event = SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                            cpu_children=[], kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
                            device_type=getattr(DeviceType, device), self_cpu_time_total=0.0,
                            is_user_annotation=name.startswith("moe.") if annotation is None else annotation)
    if parent is not None:
        parent.cpu_children.append(event)
    return event


def test_on_cuda_a_phase_counts_its_kernels_not_its_ranges_span_and_unlinked_kernels_are_shown() -> None:
    """A profile as kineto gives it on a GPU: kernels ride on the operator (or range: a Triton
    launch) that launched them; a range also gets its GPU-side span as a 'kernel' of its own name,
    which must not count twice; a kernel the profiler could not link to a launch is reported."""
    block = _event("moe.block", 0, 100, kernels=[("moe.block", 95.0)])
    index = _event("aten::index", 2, 4, block, kernels=[("index_elementwise_kernel", 5.0)])
    gate_up = _event("moe.gate_up", 10, 40, block, kernels=[("moe.gate_up", 60.0)])
    dequant = _event("moe.dequant", 11, 20, gate_up, kernels=[("nf4_dequantize", 30.0)])
    base = _event("moe.mm.base", 21, 30, gate_up)
    grouped = _event("aten::_grouped_mm", 22, 29, base, kernels=[("cutlass_grouped", 20.0)])
    down = _event("moe.down", 50, 60, block)
    combine = _event("aten::index_add_", 70, 72, block, kernels=[("index_add_kernel", 4.0)])
    device = [_event(name, 0, d, device="CUDA", annotation=False) for name, d in (
        ("index_elementwise_kernel", 5.0), ("nf4_dequantize", 30.0), ("cutlass_grouped", 20.0),
        ("index_add_kernel", 4.0), ("unlinked_kernel", 7.0))]
    device.append(_event("moe.block", 0, 95, device="CUDA", annotation=True))
    found = attribute([block, index, gate_up, dequant, base, grouped, down, combine, *device], cuda=True, steps=1)
    forward = found["by_pass"]["forward"]
    assert {k: v["ms"] for k, v in forward.items()} == {"permute": 0.005, "dequant.gate_up": 0.03,
                                                       "products.gate_up": 0.02, "combine": 0.004}
    assert forward["dequant.gate_up"]["kernels"] == 1
    assert found["unattributed_ms"] == pytest.approx(0.007)
    top = {k["name"]: k for k in found["top_kernels"]}
    assert top["nf4_dequantize"]["where"] == ["forward:dequant.gate_up"] and top["unlinked_kernel"]["where"] == ["unlinked"]
    assert "moe.block" not in top
    assert found["calls_per_step"]["forward"] == {"moe.gate_up": 1, "dequant.gate_up": 1, "products.gate_up": 1,
                                                  "moe.down": 1}


def test_a_triton_kernel_on_an_expert_product_s_own_record_is_its_projection_s_dequantization() -> None:
    """What the H200's profile showed (the 23rd session's moe_layer_profile_qwen3.json): the NF4
    kernel rides on the ExpertProduct record (forward) and on the ExpertProductBackward node's
    (backward), outside the ``moe.dequant`` range, and landed in ``sort`` and ``activation`` (by
    where the record starts) and in the backward's ``other``: 0.9 ms a step that belonged to the
    dequantization. It lands in the dequantization of the projection the record holds."""
    block = _event("moe.block", 0, 100)
    product = _event("ExpertProduct", 10, 40, block, kernels=[("nf4_dequantize", 30.0)],
                     annotation=False)
    gate_up = _event("moe.gate_up", 11, 39, product)
    _event("moe.dequant", 12, 20, gate_up)
    down_product = _event("ExpertProduct", 50, 70, block, kernels=[("nf4_dequantize", 15.0)], annotation=False)
    _event("moe.down", 51, 69, down_product)
    node = _event(EVALUATE + "ExpertProductBackward", 200, 300, annotation=False)
    backward = _event("ExpertProductBackward", 201, 299, node, kernels=[("nf4_dequantize", 14.0)], annotation=False)
    _event("moe.down", 202, 298, backward)
    events = [block, product, gate_up, down_product, node, backward]
    found = attribute(events, cuda=True, steps=1)
    assert {k: v["ms"] for k, v in found["by_pass"]["forward"].items()} == {"dequant.gate_up": 0.03,
                                                                           "dequant.down": 0.015}
    assert {k: v["ms"] for k, v in found["by_pass"]["backward"].items()} == {"dequant.down": 0.014}


def _qwen3(active: int = 128, rank: int = 0) -> Dims:
    e, i, h = 128, 768, 2048
    nf4 = {"gate_up": e * 2 * i * h // 2 + e * 2 * i * h // 64, "down": e * i * h // 2 + e * i * h // 64}
    return Dims(tokens=2048, hidden=h, width=i, experts=e, top_k=8, active=active, value_bytes=2, stored=nf4,
                rank=rank)


def test_the_traffic_model_and_the_ideal_are_qwen3_30b_a3bs_arithmetic() -> None:
    """Qwen3-30B-A3B's layer at 2,048 tokens: 16,384 rows through 128 experts of 768; the forward's
    products 154.6 GFLOP, a step three times that (forward, recomputation, input gradients); each
    dequantization writes every expert in bf16 besides reading the packed ones; the ideal reads
    the packed weights of the experts with tokens once."""
    d = _qwen3()
    moved = traffic(d)
    rows = 2048 * 8
    assert moved["forward"]["products.gate_up"]["flops"] == 2 * rows * 2048 * 1536
    assert moved["backward"]["products.down"]["flops"] == 2 * rows * 768 * 2048
    assert moved["forward"]["dequant.gate_up"]["bytes"] == d.stored["gate_up"] + 128 * 1536 * 2048 * 2
    assert moved["backward"]["dequant.down"] == moved["forward"]["dequant.down"]
    assert "lora.gate_up" not in moved["forward"]
    best = ideal(d, flops_peak=989e12, bytes_peak=4.8e12)
    assert best["flops_per_step"] == pytest.approx(3 * 154.62e9, rel=0.01)
    assert best["stored_bytes_once"] == sum(d.stored.values())
    assert best["ideal_ms"] == pytest.approx(max(best["flops_ms"], best["stored_once_ms"]))
    assert best["ideal_ms"] == pytest.approx(0.47, abs=0.01)  # the products' FLOPs bound it, not the bytes
    assert best["fused_floor_ms"] >= best["ideal_ms"]
    assert ideal(_qwen3(active=64), 989e12, 4.8e12)["stored_bytes_once"] == sum(d.stored.values()) / 2
    with_lora = traffic(_qwen3(rank=16))
    assert with_lora["forward"]["lora.down"]["flops"] == 2 * rows * 16 * (768 + 2048) + rows * 2048
    assert with_lora["backward"]["lora.down"]["flops"] == 4 * rows * 16 * (768 + 2048)


@pytest.mark.parametrize(("name", "storage"), [("qwen3-30b-a3b", "nf4"), ("gpt-oss-20b", "mxfp4")])
def test_the_phase_ranges_change_nothing_the_engine_computes_and_are_taken_off_after(name: str, storage: str) -> None:
    from studio.core.config import FastPathConfig
    from studio.engine import fast
    from studio.engine.fast import moe

    originals = (moe.SparseMlp.route, moe.ExpertWeights.stacked, moe.Groups.mm, moe.ExpertProduct.forward,
                 moe.ExpertProduct.backward)
    model = build(name, True, storage, True, 8, "cpu", torch.float32)
    with torch.no_grad():  # LoRA's B starts at zero: give the expert adapters a value that shows
        for pname, param in model.named_parameters():
            if "lora_B" in pname:
                param.normal_(std=0.05)
    fm, why = fast.prepare(model, FastPathConfig(cuda_graphs=False))
    assert fm is not None, why
    layer = fm.layers[0]
    x = torch.randn(1, 16, layer.gate_up.weights.in_features, requires_grad=True)
    fm.router.begin(16)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        x.grad = None
        for p in (*layer.gate_up.a, *layer.down.b):
            p.grad = None
        y = run_block(layer, x)
        y.backward(torch.ones_like(y))
        return y.detach(), [x.grad.clone(), *(p.grad.clone() for p in (*layer.gate_up.a, *layer.down.b))]

    plain = run()
    with phase_ranges(layer.gate_up.weights, layer.down.weights):
        assert moe.Groups.mm is not originals[2]
        ranged = run()
    torch.testing.assert_close(ranged[0], plain[0], rtol=0, atol=0)
    for got, want in zip(ranged[1], plain[1], strict=True):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (moe.SparseMlp.route, moe.ExpertWeights.stacked, moe.Groups.mm, moe.ExpertProduct.forward,
            moe.ExpertProduct.backward) == originals


def test_mxfp4_is_refused_for_a_model_that_does_not_ship_it() -> None:
    assert storage_for("gpt-oss-20b", "auto") == "mxfp4" and storage_for("mixtral-8x7b", "auto") == "nf4"
    with pytest.raises(SystemExit, match="--storage mxfp4: mixtral-8x7b does not ship MXFP4"):
        storage_for("mixtral-8x7b", "mxfp4")


def test_the_tiny_run_profiles_every_pass_and_phase_and_writes_what_a_gpu_result_needs(
        tmp_path: Path, studio_env: dict, python: str) -> None:
    out = tmp_path / "profile.json"
    done = subprocess.run([python, str(REPO / "bench" / "moe_layer_profile.py"), "--tiny", "--model",
                           "qwen3-30b-a3b,gpt-oss-20b", "--tokens", "32", "--warmup", "1", "--loops", "1",
                           "--repeats", "1", "--profile-steps", "1", "--commit", "abc123", "--out", str(out)],
                          cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["commit"] == "abc123" and report["versions"]["torch"] and report["gpu"] == "cpu"
    assert report["peaks"]["used"]["flops"] > 0 and report["tokens"] == 32
    formats = {"qwen3-30b-a3b": "PackedExperts", "gpt-oss-20b": "Mxfp4Experts"}
    for name, entry in report["models"].items():
        for variant, row in entry["variants"].items():
            assert not [k for k, v in row.items() if isinstance(v, dict) and "error" in v], row
            block = row["engine_block"]
            assert block["storage"]["format"] == formats[name]
            assert block["routing"]["rows"] == 32 * 2 and block["routing"]["experts"] == 4
            phases = block["profile"]["by_phase_ms"]
            for kind in ("dequant", "products"):
                assert set(phases[f"{kind}.gate_up"]) == {"forward", "recompute", "backward", "total"}
            # the recomputation skips down's product: a zero that owns no memory in its place
            assert set(phases["dequant.down"]) == {"forward", "backward", "total"}
            for proj in ("gate_up", "down"):
                assert (f"lora.{proj}" in phases) == (variant == "experts")
            assert {"router", "sort", "permute", "activation", "combine"} <= set(phases)
            calls = block["profile"]["calls_per_step"]  # the recomputation takes the forward's routing
            assert calls["forward"]["sort"] == 1 and "sort" not in calls["recompute"]
            # every expert dequantized once per projection in each pass, but down in the recomputation;
            # gate/up in its two halves (engine/fast/moe.py's PARTS), a call each, NF4 and MXFP4 alike
            dequant = block["model"]["dequantization"]
            assert dequant["experts_per_call"] == 4
            assert [dequant[f"{p}.{proj}_calls"] for p in ("forward", "recompute", "backward")
                    for proj in ("gate_up", "down")] == [2.0, 1.0, 2.0, 0, 2.0, 1.0]
            assert block["model"]["ideal"]["ideal_ms"] > 0 and block["eager"]["step"]["median_ms"] > 0
            assert row["engine_layer"]["eager"]["step"]["median_ms"] > 0
            assert row["engine_layer"]["eager"]["routing"]["rows"] == 32 * 2
            # the skewed stream leaves experts without tokens, and the grouped products agree with the loop
            skewed = row["engine_block_skewed"]
            assert skewed["routing"]["experts_with_tokens"] < 4 and skewed["routing"]["rows_per_expert"]["min"] == 0
            compared = skewed["grouped_vs_loop"]
            for key in ("output", "input_grad", *(["adapter_grads"] if variant == "experts" else [])):
                assert compared[f"{key}_max_abs_diff"] <= 1e-5 * compared[f"{key}_max_abs"], compared
            assert row["hf_block"]["experts_implementation"] and row["hf_block"]["step"]["median_ms"] > 0
            assert row["summary"]["layer_speedup_vs_hf"] > 0
            assert row["summary"]["engine_eager_ms"] and row["summary"]["top_phases"]


def test_isolated_sections_land_where_one_process_puts_them_and_launch_blocking_reaches_its_section(
        tmp_path: Path, studio_env: dict, python: str) -> None:
    """The GPU's way (each section in a process of its own, bench/isolated.py), here on the CPU:
    the peaks and every section's result in the same places, CUDA_LAUNCH_BLOCKING in the section
    asked for only."""
    out = tmp_path / "isolated.json"
    done = subprocess.run([python, str(REPO / "bench" / "moe_layer_profile.py"), "--tiny", "--model", "qwen3-30b-a3b",
                           "--variants", "attn", "--tokens", "32", "--warmup", "1", "--loops", "1", "--repeats", "1",
                           "--skip", "profile,hf", "--isolate", "on", "--launch-blocking", "engine_layer_eager",
                           "--out", str(out)], cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["isolated"] and report["launch_blocking"] == ["engine_layer_eager"]
    assert report["gpu"] == "cpu" and report["peaks"]["used"]["flops"] > 0
    row = report["models"]["qwen3-30b-a3b"]["variants"]["attn"]
    assert set(row) == {"engine_block", "engine_block_skewed", "engine_layer", "summary"}
    assert row["engine_block"]["storage"]["format"] == "PackedExperts" and "launch_blocking" not in row["engine_block"]
    assert row["engine_block"]["model"]["ideal"]["ideal_ms"] > 0  # the peaks reached the section's process
    assert row["engine_block_skewed"]["routing"]["rows_per_expert"]["min"] == 0
    assert row["engine_layer"]["eager"]["launch_blocking"] and row["engine_layer"]["eager"]["step"]["median_ms"] > 0
    assert row["summary"]["block_share_of_layer_step"] > 0
