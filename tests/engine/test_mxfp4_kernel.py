"""The one-kernel MXFP4 dequantization (studio/engine/fast/mxfp4_dequant.py) gives the torch way's
values to the bit (studio/engine/mxfp4.py): every byte code under every scale byte, into contiguous
and transposed outputs, in Triton's interpreter on the CPU and compiled on the GPU; the kernel is
what ``dequantize_mxfp4`` runs where it can, the torch way where it fails or is switched off."""

from __future__ import annotations

import pytest
import torch
from helpers.gpt_oss import random_mxfp4

pytest.importorskip("triton")

from studio.engine import mxfp4  # noqa: E402
from studio.engine.fast import mxfp4_dequant  # noqa: E402

INTERPRETER = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton's interpreter on the CPU; a GPU box runs the compiled kernel at real shapes instead (the "
           "H200 box's Triton 3.6 interpreter is broken)")
"""The tests that run the kernel in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors."""

pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
"""numpy's notes on the interpreter's infinities and NaN, which the torch way makes too."""

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter (numpy on the CPU) for the kernel built in this test; compiled again after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def every_code_and_scale(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``[256, 512]`` weights: row ``s`` holds every byte code (each nibble under each) at scale byte
    ``s``, 0 (2^-127, subnormal) to 255 (NaN)."""
    blocks = torch.arange(256, dtype=torch.uint8, device=device).view(1, 16, 16).expand(256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8, device=device).view(256, 1).expand(256, 16).contiguous()
    return blocks, scales


def torch_way(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
    return mxfp4.dequantize_mxfp4(blocks, scales, dtype, out, kernel=False)


def by_kernel(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` written by the kernel alone, every value first set to a NaN it never writes."""
    out.view(BITS[out.dtype]).fill_(-1)
    mxfp4_dequant.dequantize(blocks, scales, out)
    return out


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit for bit, but for NaN (the scale byte 255's), whose payload the float units choose."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan), f"{(ours.isnan() != nan).sum().item()} values NaN in one only"
    bits = BITS[ours.dtype]
    differ = (ours.view(bits) != theirs.view(bits)) & ~nan
    assert not differ.any(), f"{differ.sum().item()} of {ours.numel()} values differ from the torch way's"


def _transposed(shape: tuple[int, int, int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """An ``[experts, rows, in]`` view of a contiguous ``[experts, in, rows]`` (the parameter's layout)."""
    experts, rows, width = shape
    return torch.empty(experts, width, rows, dtype=dtype, device=device).transpose(1, 2)


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_code_under_every_scale_is_the_torch_way_s_value(interpreted, dtype: torch.dtype) -> None:
    """All 256 byte codes (both nibbles, the lower first) under all 256 scale bytes: subnormal
    products, fp16's flush to 0 and overflow to infinity, the NaN scale."""
    blocks, scales = every_code_and_scale()
    theirs = torch_way(blocks, scales, dtype)
    subnormal = (theirs != 0) & (theirs.abs() < torch.finfo(dtype).tiny)
    assert theirs.isinf().any() and theirs.isnan().any() and subnormal.any()  # the extremes are in there
    assert_same_bits(by_kernel(blocks, scales, torch.empty_like(theirs)), theirs)


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 40, 96), (2, 17, 320), (1, 5, 32), (4, 33, 288)])
def test_random_weights_contiguous_and_transposed(interpreted, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Experts of rows and blocks that tiles do not divide (the last tiles part-full), as a new
    contiguous tensor and through a transposed view, scales over every byte."""
    blocks, _ = random_mxfp4(shape, seed=sum(shape))
    scales = torch.randint(0, 256, blocks.shape[:-1], dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    theirs = torch_way(blocks, scales, dtype)
    assert_same_bits(by_kernel(blocks, scales, torch.empty(shape, dtype=dtype)), theirs)
    assert_same_bits(by_kernel(blocks, scales, _transposed(shape, dtype)), theirs)
    assert_same_bits(by_kernel(blocks[0], scales[0], torch.empty(shape[1:], dtype=dtype)), theirs[0])


@INTERPRETER
@pytest.mark.parametrize("window", [(0, 20), (20, 20), (7, 13)])
def test_a_window_of_every_expert_s_rows_is_those_rows_of_the_whole(interpreted, window) -> None:
    """Some rows of every expert (gate/up in halves, engine/fast/moe.py), by the kernel and the torch
    way: those rows of the whole weight, bit for bit."""
    shape = (3, 40, 96)
    blocks, scales = random_mxfp4(shape, seed=5)
    whole = torch_way(blocks, scales, torch.bfloat16)
    first, rows = window
    want = whole[:, first:first + rows]
    out = torch.empty(3, rows, 96, dtype=torch.bfloat16).view(torch.int16).fill_(-1).view(torch.bfloat16)
    mxfp4_dequant.dequantize(blocks, scales, out, window)
    assert_same_bits(out, want)
    assert_same_bits(mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16, kernel=False, window=window), want)
    assert_same_bits(mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16, kernel=True, window=window), want)


@INTERPRETER
def test_dequantize_mxfp4_runs_the_kernel_where_it_can(interpreted, monkeypatch) -> None:
    """Under the interpreter (as on CUDA) the experts' dequantization is the kernel's: the torch way's
    table is never built; with ``trainer.fast_path.kernels`` off (the fast path's ExpertWeights) it is."""
    from studio.engine.fast.frozen import Workspace
    from studio.engine.fast.moe import ExpertWeights

    blocks, scales = random_mxfp4((2, 24, 64), seed=3)
    theirs = torch_way(blocks, scales, torch.bfloat16)
    stored = mxfp4.Mxfp4Experts(torch.nn.Parameter(torch.empty(2, 64, 24)), blocks, scales)
    built = []
    table = mxfp4._pair_table.__wrapped__
    monkeypatch.setattr(mxfp4, "_pair_table", lambda *args: built.append(args) or table(*args))
    assert_same_bits(stored.dequantize(torch.bfloat16), theirs)
    assert_same_bits(mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16, _transposed((2, 24, 64), torch.bfloat16)),
                     theirs)
    assert built == []
    with pytest.raises(ValueError, match=r"dequantize to \(2, 24, 64\), not into \(2, 24, 32\)"):
        mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16, torch.empty(2, 24, 32, dtype=torch.bfloat16))
    for setting in (True, False):
        workspace = Workspace()
        weights = ExpertWeights(stored.param, torch.bfloat16, stored, workspace, kernel=setting, transposed=True)
        workspace.allocate(torch.bfloat16, torch.device("cpu"))
        assert_same_bits(weights.stacked(), theirs)
        assert len(built) == (0 if setting else 1)


@INTERPRETER
def test_a_kernel_that_fails_leaves_the_torch_way_doing_the_work(interpreted, monkeypatch) -> None:
    """A Triton that cannot build the kernel for this GPU must not stop training: the weights come
    from the torch way, with one warning that says why, and later calls do not try the kernel."""
    calls = []

    class Unbuildable:
        def __getitem__(self, grid):
            calls.append(grid)
            raise RuntimeError("PassManager::run failed")

    blocks, scales = random_mxfp4((2, 24, 64), seed=4)
    theirs = torch_way(blocks, scales, torch.bfloat16)
    with monkeypatch.context() as patch:
        patch.setattr(mxfp4_dequant.KERNELS, "get", lambda: {"mxfp4_dequantize": Unbuildable()})
        patch.setattr(mxfp4_dequant.KERNELS, "_broken", {})
        with pytest.warns(RuntimeWarning, match="MXFP4 dequantization kernel failed .*PassManager::run failed"):
            assert_same_bits(mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16), theirs)
        assert_same_bits(mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16), theirs)
        assert len(calls) == 1 and not mxfp4_dequant.available(torch.device("cpu"))
    assert mxfp4_dequant.KERNELS.broken == ""


def test_without_cuda_or_the_interpreter_the_torch_way_runs(monkeypatch) -> None:
    """On the CPU, compiled Triton cannot run: the kernel is not offered there."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not mxfp4_dequant.available(torch.device("cpu"))
    blocks, scales = random_mxfp4((1, 8, 64), seed=5)
    assert mxfp4.dequantize_mxfp4(blocks, scales, torch.float32).shape == (1, 8, 64)


GPT_OSS_20B = (32, 5760, 2880)
"""gpt-oss-20b's gate/up projection ``[experts, 2 x intermediate, hidden]`` (down: 2880 x 2880)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_compiled_on_the_gpu_at_gpt_oss_20b_s_expert_shape(layout: str) -> None:
    """[32, 5760, 2880 / 32, 16] blocks, scales over every byte, into the fast path's contiguous
    workspace layout and the hook's transposed parameter: the torch way's values, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = torch.randint(0, 256, (*GPT_OSS_20B[:2], GPT_OSS_20B[2] // 32, 16), dtype=torch.uint8, device="cuda",
                           generator=g)
    scales = torch.randint(0, 256, blocks.shape[:-1], dtype=torch.uint8, device="cuda", generator=g)
    theirs = torch_way(blocks, scales, torch.bfloat16)
    out = torch.empty_like(theirs) if layout == "contiguous" else _transposed(GPT_OSS_20B, torch.bfloat16, "cuda")
    assert_same_bits(by_kernel(blocks, scales, out), theirs)
    del theirs
    assert_same_bits(mxfp4.dequantize_mxfp4(blocks, scales, torch.bfloat16), torch_way(blocks, scales, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_on_the_gpu_every_code_under_every_scale(dtype: torch.dtype) -> None:
    blocks, scales = every_code_and_scale("cuda")
    theirs = torch_way(blocks, scales, dtype)
    assert_same_bits(by_kernel(blocks, scales, torch.empty_like(theirs)), theirs)
    assert_same_bits(by_kernel(blocks, scales, _transposed((1, 256, 512), dtype, "cuda"))[0],
                     theirs)
