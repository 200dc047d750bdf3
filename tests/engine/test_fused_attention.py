"""engine/fast/fused_attention.py: Gemma 2's soft-capped scores and gpt-oss' attention sinks in
Studio's Triton kernels, forward and backward, against EagerAttention (the plain-torch attention it
replaces on the GPU): the output and the gradients of q, k and v, for every layout a step makes
(full rows, one stream of packed examples with boundaries on the device or on the host, empty
examples), sliding windows (shorter and longer than the rows), fewer key/value heads, a scale of the
description's. On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), with
small blocks so short examples span several; on a GPU the real shapes, compiled, and a forward and
backward captured in a CUDA graph."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

from studio.engine.fast import attention, fused_attention  # noqa: E402
from studio.engine.fast.attention import Segments, Span, attend  # noqa: E402

INTERPRETER = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton's interpreter on the CPU; a GPU box runs the compiled kernels at real shapes instead (the "
           "H200 box's Triton 3.6 interpreter fails on these kernels with a numpy TypeError)")
"""The tests that run the kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors."""

CASES = {
    # name: (batch, tokens, heads, kv_heads, head_dim, span, sinks, cu)
    "softcap": (2, 40, 4, 2, 16, Span(softcap=5.0), False, None),
    "softcap_window_packed": (1, 53, 4, 2, 16, Span(window=9, softcap=5.0), False, [0, 13, 13, 37, 53]),
    # an example of one token; one that starts a key before a block of queries, and ends one query
    # after the block that holds the last key of a block of keys
    "sinks_packed": (1, 50, 4, 4, 16, Span(), True, [0, 20, 21, 31, 49, 50]),
    # a window whose reach starts one key before a block of keys, and ends one query after one
    "sinks_window_gqa": (1, 60, 4, 1, 16, Span(window=18), True, None),
    "softcap_sinks_scale_odd_width": (1, 45, 2, 1, 24, Span(scale=0.3, window=17, softcap=3.0), True, [0, 30, 45]),
    "window_longer_than_rows": (1, 40, 4, 2, 16, Span(window=1000, softcap=5.0), False, [0, 17, 40]),
}


def _inputs(case: str, dtype: torch.dtype, device: torch.device):
    b, t, heads, kv_heads, head_dim, span, sinks, cu = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    # large enough scores that the cap bites and a sink's share of the softmax is not negligible
    q = 3 * torch.randn(b, t, heads, head_dim, generator=gen)
    k = torch.randn(b, t, kv_heads, head_dim, generator=gen)
    v = torch.randn(b, t, kv_heads, head_dim, generator=gen)
    dout = torch.randn(b, t, heads, head_dim, generator=gen)
    sink = 2 * torch.randn(heads, generator=gen) if sinks else None
    seg = Segments(cu=torch.tensor(cu, dtype=torch.int32, device=device), max_len=t) if cu else Segments()
    tensors = [x.to(device, dtype) for x in (q, k, v, dout)]
    return tensors, span, sink.to(device) if sinks else None, seg


def _run(q, k, v, dout, seg, span, sinks, fused: bool):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, seg, None, span, sinks, fused=fused)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def _spy(monkeypatch) -> list[str]:
    """Which attention ran, call by call."""
    calls: list[str] = []
    for name, cls in (("eager", attention.EagerAttention), ("fused", fused_attention.FusedAttention)):
        apply = cls.apply

        def recorded(*args, name=name, apply=apply):
            calls.append(name)
            return apply(*args)
        monkeypatch.setattr(cls, "apply", recorded)
    return calls


@INTERPRETER
@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_attention_equals_the_eager_one_in_fp32(case: str, monkeypatch) -> None:
    """Output, dq, dk and dv equal EagerAttention's to fp32's rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (q, k, v, dout), span, sinks, seg = _inputs(case, torch.float32, torch.device("cpu"))
    calls = _spy(monkeypatch)
    expected = _run(q, k, v, dout, seg, span, sinks, fused=False)
    got = _run(q, k, v, dout, seg, span, sinks, fused=True)
    assert calls == ["eager", "fused"]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        assert b.abs().max() > 0.1, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@INTERPRETER
def test_examples_of_a_stream_see_nothing_of_each_other(monkeypatch) -> None:
    """A packed stream's examples (boundaries on the device, or the host's bounds of an eager step)
    give each the same output and gradients as that example alone: nothing leaks across a boundary."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (q, k, v, dout), span, sinks, seg = _inputs("softcap_window_packed", torch.float32, torch.device("cpu"))
    stream = _run(q, k, v, dout, seg, span, sinks, fused=True)
    bounds = ((0, 13), (13, 37), (37, 53))
    host = _run(q, k, v, dout, Segments(bounds=bounds), span, sinks, fused=True)
    for a, b in bounds:
        alone = _run(q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], Segments(), span, sinks, fused=True)
        for whole, by_host, part in zip(stream, host, alone, strict=True):
            torch.testing.assert_close(whole[:, a:b], part, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(by_host[:, a:b], part, rtol=1e-5, atol=1e-6)


@INTERPRETER
@pytest.mark.parametrize("case", ["softcap_window_packed", "sinks_window_gqa"])
def test_in_bf16_the_fused_attention_is_as_close_to_fp32_as_the_eager_one(case: str, monkeypatch) -> None:
    """bf16 inputs: the fused attention's output and gradients are no further from fp32's exact
    values than EagerAttention's own bf16 ones are (a few bf16 roundings)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    (q, k, v, dout), span, sinks, seg = _inputs(case, torch.float32, cpu)
    exact = _run(q, k, v, dout, seg, span, sinks, fused=False)
    half = [x.to(torch.bfloat16) for x in (q, k, v, dout)]
    eager = _run(*half, seg, span, sinks, fused=False)
    fused = _run(*half, seg, span, sinks, fused=True)
    for name, want, e, f in zip(("out", "dq", "dk", "dv"), exact, eager, fused, strict=True):
        assert f.dtype == torch.bfloat16
        eager_err = ((e.float() - want).norm() / want.norm()).item()
        fused_err = ((f.float() - want).norm() / want.norm()).item()
        assert fused_err < 1.5 * eager_err + 2e-3, (name, fused_err, eager_err)


def test_where_the_kernels_cannot_run_the_eager_attention_does(monkeypatch) -> None:
    """On the CPU without the interpreter, for an fp32 model on a GPU and for heads wider than the
    kernels' 256, ``fused=True`` still attends, through EagerAttention."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_attention.available(torch.device("cpu"), torch.bfloat16, 64)
    assert not fused_attention.available(torch.device("cuda"), torch.float32, 64)
    assert not fused_attention.available(torch.device("cuda"), torch.bfloat16, 512)
    (q, k, v, dout), span, sinks, seg = _inputs("sinks_packed", torch.float32, torch.device("cpu"))
    calls = _spy(monkeypatch)
    out = attend(q, k, v, seg, None, span, sinks, fused=True)
    assert calls == ["eager"] and out.shape == q.shape


@INTERPRETER
def test_a_backward_kernel_that_fails_to_build_gives_the_eager_gradients(monkeypatch) -> None:
    """The forward's kernel built, the backward's did not: that step's gradients are EagerAttention's,
    one warning says so, and the next steps run the eager attention from the start."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_attention.KERNELS, "_broken", {})

    def fails(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")
    monkeypatch.setattr(fused_attention, "backward", fails)
    (q, k, v, dout), span, sinks, seg = _inputs("softcap_sinks_scale_odd_width", torch.float32, torch.device("cpu"))
    expected = _run(q, k, v, dout, seg, span, sinks, fused=False)
    calls = _spy(monkeypatch)
    with pytest.warns(RuntimeWarning, match="soft-capped attention kernels failed .*shared memory"):
        got = _run(q, k, v, dout, seg, span, sinks, fused=True)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert fused_attention.broken()
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(q, k, v, dout, seg, span, sinks, fused=True)
    assert calls == ["eager"]


@INTERPRETER
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_gemma_2_and_gpt_oss_train_through_the_fused_attention_as_through_transformers(family, monkeypatch) -> None:
    """The tiny Gemma 2 (soft-capped scores, a sliding layer and a global one) and gpt-oss (sinks,
    the same two kinds of layer) on the fast path with the fused attention in every layer: the loss
    and every LoRA gradient equal transformers' own model's, padded and packed (tests/engine/
    test_fast_families.py's check, fp32, under the interpreter)."""
    from test_fast_families import _check_family
    from test_fast_families import _config as family_config
    from test_fast_families import _peft as family_peft
    from test_fast_moe import _config as moe_config
    from test_fast_moe import _peft as moe_peft

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = family_peft(family_config("gemma2")) if family == "gemma2" else moe_peft(moe_config("gpt_oss"))
    calls = _spy(monkeypatch)
    _check_family(model, monkeypatch, padded_reference=family == "gpt_oss")
    assert calls and set(calls) == {"fused"}


@INTERPRETER
def test_a_layer_recomputed_from_host_memory_runs_no_attention_forward_again(monkeypatch) -> None:
    """Gemma 2's layers with their inputs in host memory keep the fused attention's output and
    log-sum-exp beside q, k and v, and their recomputation takes them back: a step runs the forward
    kernel once a layer, where torch's checkpointing (which keeps nothing) runs it twice, in the
    forward and in the recomputation; the loss and every LoRA gradient are that path's. A budget
    that fits one layer's q, k and v and nothing more, or nothing at all, leaves the other layers
    running the forward again (all but the last, whose tensors stay on the device), to the same
    gradients."""
    from test_fast_families import _batch, _grads
    from test_fast_families import _config as family_config
    from test_fast_families import _peft as family_peft

    from studio.engine import fast
    from studio.engine.fast.offload import ATTENTION, HostInputs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = family_peft(family_config("gemma2"))
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    layers = len(fast_model.layers)
    assert layers >= 2 and all(layer.fused_attention for layer in fast_model.layers)
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    launched = []
    real = fused_attention.forward

    def counting(*args, **kwargs):
        launched.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(fused_attention, "forward", counting)
    batch = _batch(packing=True)
    tokens = batch.input_ids.numel()
    config = family_config("gemma2")
    one_qkv = tokens * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim * 4
    cpu = torch.device("cpu")
    # name: (host, forward kernels a step runs, layers whose attention waits on the host)
    runs = {"torch's checkpointing": (None, 2 * layers, set()),
            "host": (HostInputs(cpu), layers, set(range(layers - 1))),
            "host, one layer's q, k, v": (HostInputs(cpu, keep_budget=one_qkv), 2 * layers - 1, set()),
            "host, no budget": (HostInputs(cpu, keep_budget=0), 2 * layers - 1, set())}
    results = {}
    for name, (host, forwards, kept) in runs.items():
        fast_model._host = host
        model.zero_grad(set_to_none=True)
        launched.clear()
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        assert len(launched) == forwards, (name, len(launched))
        results[name] = (loss.detach(), _grads(model))
        if host is not None:
            assert not host._stored and not host._fetched, name  # everything kept came back once
            on_host = {key[0] for key in host._host if isinstance(key, tuple) and key[1] in ATTENTION}
            assert on_host == kept, name
    loss0, grads0 = results.pop("torch's checkpointing")
    assert grads0
    for name, (loss, grads) in results.items():
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        assert grads.keys() == grads0.keys(), name
        for key, grad in grads0.items():
            assert grad.abs().sum() > 0, key
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name, key=key: f"{name}, {key}: {m}")


def test_a_tile_too_large_for_the_card_gives_way_to_the_next_smaller_one(monkeypatch) -> None:
    """Compiled (not interpreted), a tile whose shared memory the card lacks fails at its launch:
    the next of the pass's tiles runs instead, and later calls start from it; past the last, the
    failure goes up (and the engine gives the kernels up: the eager attention)."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(fused_attention, "interpreted", lambda: False)
    monkeypatch.setattr(fused_attention, "_chosen", {})
    tiles = fused_attention.TILES["dkdv"][256]
    tried = []

    def run(tile) -> None:
        tried.append(tile)
        if tile == tiles[0]:
            raise OutOfResources(114688, 101376, "shared memory")

    fused_attention._launch("dkdv", 256, run)
    fused_attention._launch("dkdv", 256, run)
    assert tried == [tiles[0], tiles[1], tiles[1]]

    def too_large(tile) -> None:
        raise OutOfResources(114688, 101376, "shared memory")
    with pytest.raises(OutOfResources):
        fused_attention._launch("forward", 256, too_large)


H100_SHARED = 232448
"""An H100's shared memory a block may opt into (227 KB)."""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests below compile and run them for the card")
@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_kernels_compile_for_an_h100_and_their_first_tiles_fit_it(head_dim: int, monkeypatch) -> None:
    """Jitted as the engine jits them (with the device functions they call) and compiled as it
    launches them in bf16 (every switch on: soft-cap, window, examples, sinks), for an H100 (sm_90,
    by the ptxas Triton ships: no GPU needed), with each pass's first tile for Gemma-2-9B's 256-wide
    heads and gpt-oss' 64-wide ones: they build, and their shared memory is within the card's. (The
    interpreter runs none of the compiler's checks.)"""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = fused_attention.KERNELS.get()
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    kinds = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "sinks_ptr": "*fp32", "start_ptr": "*i32", "end_ptr": "*i32",
             "scale": "fp32", "cap": "fp32"}
    switches = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, CAP=True, WINDOW=True, SEGMENTS=True, INTERPRETED=False)
    passes = {"forward": ("attention_forward", dict(SINKS=True, ADD=None, GREATEST=None)),
              "dq": ("attention_backward_dq", {}), "dkdv": ("attention_backward_dkdv", {})}
    for step, (name, extra) in passes.items():
        block_m, block_n, warps, stages = fused_attention.TILES[step][head_dim][0]
        fn = kernels[name]
        constants = dict(switches, BLOCK_M=block_m, BLOCK_N=block_n, **extra)
        signature = {arg: "constexpr" if arg in constants else kinds.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
                     for arg in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        assert 0 < compiled.metadata.shared <= H100_SHARED, (step, compiled.metadata.shared)


def _gpu_inputs(t: int, heads: int, kv_heads: int, head_dim: int, sinks: bool, cu: list[int] | None):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(t + heads)
    q = 3 * torch.randn(1, t, heads, head_dim, generator=gen, device=device)
    k = torch.randn(1, t, kv_heads, head_dim, generator=gen, device=device)
    v = torch.randn(1, t, kv_heads, head_dim, generator=gen, device=device)
    dout = torch.randn(1, t, heads, head_dim, generator=gen, device=device)
    sink = 2 * torch.randn(heads, generator=gen, device=device) if sinks else None
    seg = Segments(cu=torch.tensor(cu, dtype=torch.int32, device=device), max_len=t) if cu else Segments()
    return (q, k, v, dout), sink, seg


GPU_SHAPES = {
    # Gemma-2-9B: 16 heads, 8 key/value heads, 256 wide, scores capped at 50, scale 1/sqrt(224)
    # (query_pre_attn_scalar), a 4096-token window (longer than the rows: global) and a shorter one
    "gemma-2-9b_global": (2048, 16, 8, 256, Span(scale=224 ** -0.5, window=4096, softcap=50.0), False, None),
    "gemma-2-9b_window_packed": (2048, 16, 8, 256, Span(scale=224 ** -0.5, window=512, softcap=50.0), False,
                                 [0, 700, 700, 1900, 2048]),
    # gpt-oss-20b: 64 heads, 8 key/value heads, 64 wide, sinks, a 128-token window every other layer
    "gpt-oss-20b_window": (2048, 64, 8, 64, Span(window=128), True, [0, 1000, 2048]),
    "gpt-oss-20b_global": (2048, 64, 8, 64, Span(), True, None),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_on_the_gpu_at_real_shapes_the_fused_attention_is_as_close_as_the_eager_one(shape: str, monkeypatch) -> None:
    """Compiled, in bf16, at Gemma-2-9B's and gpt-oss-20b's shapes: output and gradients no further
    from fp32's exact values than EagerAttention's bf16 ones."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t, heads, kv_heads, head_dim, span, sinks, cu = GPU_SHAPES[shape]
    (q, k, v, dout), sink, seg = _gpu_inputs(t, heads, kv_heads, head_dim, sinks, cu)
    assert fused_attention.available(q.device, torch.bfloat16, head_dim)
    exact = _run(q, k, v, dout, seg, span, sink, fused=False)
    half = [x.to(torch.bfloat16) for x in (q, k, v, dout)]
    eager = _run(*half, seg, span, sink, fused=False)
    calls = _spy(monkeypatch)
    fused = _run(*half, seg, span, sink, fused=True)
    assert calls == ["fused"], fused_attention.broken()
    for name, want, e, f in zip(("out", "dq", "dk", "dv"), exact, eager, fused, strict=True):
        eager_err = ((e.float() - want).norm() / want.norm()).item()
        fused_err = ((f.float() - want).norm() / want.norm()).item()
        assert fused_err < 1.5 * eager_err + 2e-3, (name, fused_err, eager_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_forward_and_backward_captured_in_a_cuda_graph_replays_with_new_inputs(monkeypatch) -> None:
    """Gemma-2-9B's shape in a packed stream: after a warm-up, the fused forward and backward are
    captured in a CUDA graph; replays with other q, k, v, output gradient and example boundaries
    (same count) copied into the captured tensors give what an eager call on those gives, to the bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t, heads, kv_heads, head_dim, span, _, cu = GPU_SHAPES["gemma-2-9b_window_packed"]
    (q, k, v, dout), _, seg = _gpu_inputs(t, heads, kv_heads, head_dim, False, cu)
    static = [x.to(torch.bfloat16) for x in (q, k, v)]
    for x in static:
        x.requires_grad_()
    static_dout = dout.to(torch.bfloat16)
    calls = _spy(monkeypatch)

    def step():
        out = attend(*static, seg, None, span, None, fused=True)
        out.backward(static_dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the kernels compile here, not in the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in static:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert set(calls) == {"fused"}

    for seed, bounds in ((1, [0, 100, 1500, 1500, 2048]), (2, [0, 2048, 2048, 2048, 2048])):
        (q2, k2, v2, d2), _, seg2 = _gpu_inputs(t, heads, kv_heads, head_dim, False, bounds)
        fresh = [x.to(torch.bfloat16) * (1 + seed / 10) for x in (q2, k2, v2)]
        for into, x in zip(static, fresh, strict=True):
            into.data.copy_(x)
        static_dout.copy_(d2)
        seg.cu.copy_(seg2.cu)
        graph.replay()
        expected = _run(*fresh, d2.to(torch.bfloat16), seg2, span, None, fused=True)
        assert torch.equal(out, expected[0])
        for x, want in zip(static, expected[1:], strict=True):
            assert torch.equal(x.grad, want)


def test_a_failure_under_the_interpreter_leaves_the_compiled_kernels_usable(monkeypatch) -> None:
    """The kernels' failure is kept per way of running them: one under Triton's interpreter (an old
    Triton's, say) gives up the interpreted kernels only, not those compiled for the card."""
    monkeypatch.setattr(fused_attention.KERNELS, "_broken", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.warns(RuntimeWarning, match="soft-capped attention kernels failed"):
        fused_attention.KERNELS.mark_broken(TypeError("only 0-dimensional arrays can be converted"))
    assert "TypeError" in fused_attention.broken()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert fused_attention.broken() == ""
