"""Studio's own Triton kernels compile for an H100 (sm_90, by the ptxas Triton ships: no GPU needed),
each with the constants and warps the engine launches it with, and their shared memory fits the card.

The CPU tests run the kernels' arithmetic in Triton's interpreter, which runs none of the compiler's
checks: the cross-entropy kernel with its soft-cap and gradient passed every one of them and failed
to build on the GPU (a name that was a scalar before a loop and a block inside it), so every run took
liger's loss instead. Fused attention's kernels have this test in test_fused_attention.py."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from studio.engine.fast import (  # noqa: E402
    cross_entropy,
    dequant,
    dropout,
    expert_activation,
    expert_copies,
    mxfp4_dequant,
    norm,
    update,
)

H100 = GPUTarget("cuda", 90, 32)
H100_SHARED = 232448
"""An H100's shared memory a block may opt into (227 KB)."""


@pytest.fixture
def compiled(monkeypatch):
    """The kernels jitted for the compiler (not the interpreter), where Triton has its NVIDIA backend."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")


def _build(fn, constants: dict, kinds: dict, **options):
    """``fn`` compiled for an H100 with ``constants`` (its ``tl.constexpr`` parameters) and the other
    parameters' types from ``kinds`` (pointers not named there: bf16; integers: i32); its shared
    memory checked against the card's."""
    signature = {arg: "constexpr" if arg in constants else kinds.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
                 for arg in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants), target=H100, options=options)
    assert kernel.metadata.shared <= H100_SHARED, (fn.__name__, kernel.metadata.shared)
    return kernel


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_the_cross_entropy_kernel_compiles(compiled, cap: bool, grad: bool) -> None:
    """Each of the loss's four variants (Gemma 2's soft-cap or none; the evaluation's loss alone or
    the training's gradient too) over bf16 logits, in the block and warps cross_entropy.py launches."""
    fn = cross_entropy.KERNELS.get()["cross_entropy_rows"]
    constants = dict(BLOCK=cross_entropy.BLOCK, CAP=cap, GRAD=grad, INTERPRETED=False, ADD=None, GREATEST=None)
    kinds = {"targets_ptr": "*i64", "losses_ptr": "*fp32", "scale_ptr": "*fp32", "cap": "fp32"}
    _build(fn, constants, kinds, num_warps=cross_entropy.NUM_WARPS)


UPDATE_KINDS = {"scale": "fp32"}


@pytest.mark.parametrize("rank", [16, 256])
@pytest.mark.parametrize("gelu", [False, True])
def test_the_lora_update_kernels_compile(compiled, rank: int, gelu: bool) -> None:
    """The gated activation's forward and backward (SwiGLU and Gemma's GeGLU, both halves adapted,
    the down product's handed-over term on) and o's and down's residual update, in update.py's
    tiles, at the default rank and a high one (the inner size: the tiles of B^T it loads grow with
    it)."""
    kernels = update.KERNELS.get()
    block = update._rank_block(rank)
    _build(kernels["gated_forward"], dict(BLOCK_M=update.BLOCK_M, BLOCK_N=update.BLOCK_N, RANK=block, GATE=True,
                                          UP=True, DOT_F32=False, GELU=gelu), UPDATE_KINDS,
           num_warps=update.NUM_WARPS)
    block_m, block_n = update.BACKWARD_BLOCK
    _build(kernels["gated_backward"], dict(BLOCK_M=block_m, BLOCK_N=block_n, RANK=block, GATE=True, UP=True,
                                           EXTRA=True, RANK_EXTRA=block, DOT_F32=False, GELU=gelu), UPDATE_KINDS,
           num_warps=update.NUM_WARPS)
    if not gelu:  # (the residual update has no activation)
        _build(kernels["residual_update"], dict(BLOCK_M=update.BLOCK_M, BLOCK_N=update.BLOCK_N, RANK=block,
                                                DOT_F32=False), UPDATE_KINDS, num_warps=update.NUM_WARPS)


@pytest.mark.parametrize(("width", "weight"), [(576, "*bf16"), (4096, "*fp32"), (8192, "*bf16")])
def test_the_rms_norm_kernels_compile(compiled, width: int, weight: str) -> None:
    """The norm's forward and backward (with the residual stream's gradient) for SmolLM2-135M's
    576-wide rows, a 7-8B model's 4,096 and a 70B's 8,192, in the block and warps norm.py picks for
    each; a weight in bf16 or kept in fp32 (build.py)."""
    kernels = norm.KERNELS.get()
    block, warps = norm._settings(width)
    common = dict(BLOCK=block, INTERPRETED=False, ADD=None)
    kinds = {"w_ptr": weight, "rstd_ptr": "*fp32", "eps": "fp32"}
    _build(kernels["rms_norm_forward"], dict(common, ROUND=None), kinds, num_warps=warps)
    _build(kernels["rms_norm_backward"], dict(common, RESIDUAL=True), kinds, num_warps=warps)


@pytest.mark.parametrize("nested", [False, True])
def test_the_nf4_dequantization_kernel_compiles(compiled, nested: bool) -> None:
    """bitsandbytes' NF4 at its usual block of 64 values, its scales double-quantized (uint8, in
    blocks of 256) or not, in dequant.py's blocks a program and warps, without fused multiply-adds
    (as dequant.py launches it)."""
    fn = dequant.KERNELS.get()["nf4_dequantize"]
    constants = dict(NESTED=nested, HALF=32, BLOCKSIZE2=256 if nested else 1, ROWS=dequant.BLOCKS_PER_PROGRAM,
                     ROUND_BY_HAND=False)
    kinds = {"packed_ptr": "*u8", "absmax_ptr": "*u8" if nested else "*fp32", "code2_ptr": "*fp32",
             "absmax2_ptr": "*fp32", "offset_ptr": "*fp32", "code_ptr": "*fp32"}
    _build(fn, constants, kinds, num_warps=dequant.NUM_WARPS, enable_fp_fusion=False)


@pytest.mark.parametrize("out", ["*bf16", "*fp16", "*fp32"])
def test_the_mxfp4_dequantization_kernel_compiles(compiled, out: str) -> None:
    """gpt-oss' MXFP4 experts into each output dtype, in mxfp4_dequant.py's tile and warps."""
    fn = mxfp4_dequant.KERNELS.get()["mxfp4_dequantize"]
    constants = dict(ROWS=mxfp4_dequant.ROWS, GROUPS=mxfp4_dequant.GROUPS, BF16=out == "*bf16")
    _build(fn, constants, {"blocks_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": out}, num_warps=mxfp4_dequant.NUM_WARPS)


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_adapter_dropout_kernel_compiles(compiled, accumulate: bool) -> None:
    """The adapters' dropout, writing its copy or adding into one, in dropout.py's block."""
    fn = dropout._build_kernel()
    _build(fn, dict(ACCUMULATE=accumulate, BLOCK=dropout.BLOCK), {"seed_ptr": "*i64", "p": "fp32", "scale": "fp32"})


@pytest.mark.parametrize(("interleaved", "clamped"), [(False, False), (True, True)])
def test_the_expert_kernels_compile(compiled, interleaved: bool, clamped: bool) -> None:
    """The experts' routed activation, forward and backward (SiLU with gate's columns first, as
    Qwen3-MoE, Mixtral and OLMoE store them; gpt-oss' clamped SwiGLU, interleaved), and the sum of each
    token's copies (with gpt-oss' down-projection bias where the activation is gpt-oss'), in the tiles
    expert_activation.py and expert_copies.py launch."""
    kernels = expert_activation.KERNELS.get()
    # gpt-oss' case: gate/up's bias (each row's expert's, int64), gate/up in halves (the backward's
    # second launch adds to the first's fp32 weight gradient)
    kinds = {"alpha": "fp32", "limit": "fp32", "e_ptr": "*i64", "dw_ptr": "*fp32" if clamped else "*bf16"}
    switches = dict(INTERLEAVED=interleaved, CLAMPED=clamped, BIASED=clamped)
    _build(kernels["routed_forward"], dict(switches, BLOCK_M=expert_activation.BLOCK_M,
                                           BLOCK_N=expert_activation.BLOCK_N), kinds,
           num_warps=expert_activation.NUM_WARPS)
    block_m, block_n = expert_activation.BACKWARD_BLOCK
    _build(kernels["routed_backward"], dict(switches, ACCUMULATE=clamped, BLOCK_M=block_m, BLOCK_N=block_n,
                                            INTERPRETED=False, ADD=None), kinds, num_warps=expert_activation.NUM_WARPS)
    _build(expert_copies.KERNELS.get()["copies_sum"], dict(K=4 if clamped else 8, BIASED=clamped,
                                                           BLOCK_M=expert_copies.BLOCK_M,
                                                           BLOCK_N=expert_copies.BLOCK_N),
           {"pos_ptr": "*i32", "expert_ptr": "*i64"}, num_warps=expert_copies.NUM_WARPS)


@pytest.mark.parametrize(("fmt", "blocks"), [("nf4", 1), ("nf4", 2), ("nf4_nested", 2), ("mxfp4", 2),
                                            ("mxfp4", 4)])
def test_the_stored_expert_product_kernels_compile(compiled, fmt: str, blocks: int) -> None:
    """Both grouped products that read 4-bit experts as stored (engine/fast/stored_experts.py), with
    the PTX byte-permute decoding, in its tiles: NF4 with fp32 or double-quantized scales, MXFP4 with
    its exponent bytes, two or four blocks a step."""
    from studio.engine.fast import stored_experts

    kernels = stored_experts.KERNELS.get()
    nested, mx = fmt == "nf4_nested", fmt == "mxfp4"
    kinds = {"packed_ptr": "*u8", "absmax_ptr": "*u8" if nested or mx else "*fp32", "code2_ptr": "*fp32",
             "absmax2_ptr": "*fp32", "offset_ptr": "*fp32", "code_ptr": "*fp32", "offs_ptr": "*i32"}
    common = dict(EXPERTS=128, BLOCKSIZE=32 if mx else 64, NESTED=nested, BLOCKSIZE2=256 if nested else 1,
                  BLOCK_M=stored_experts.BLOCK_M, BLOCKS=blocks, ASM=True, MX=mx, FP32_DOT=False, ROUND_BY_HAND=False)
    _build(kernels["reduce_b"], dict(common, BLOCK_N=stored_experts.REDUCE_B["BLOCK_N"]), kinds,
           num_warps=stored_experts.REDUCE_B["num_warps"], num_stages=stored_experts.REDUCE_B["num_stages"])
    columns = blocks * common["BLOCKSIZE"]
    _build(kernels["reduce_a"], dict(common, BLOCK_K=128 if columns == 128 else 64), kinds, **stored_experts.REDUCE_A)
