"""The one-kernel NF4 dequantization (studio/engine/fast/dequant.py) gives bitsandbytes' values to
the bit: in Triton's interpreter on the CPU, compiled on the GPU."""

from __future__ import annotations

import pytest
import torch

bnb_functional = pytest.importorskip("bitsandbytes.functional")
pytest.importorskip("triton")

from studio.engine.fast import dequant  # noqa: E402

CASES = [
    # (rows, cols, blocksize, double-quantized scales, compute dtype)
    (96, 200, 64, True, torch.bfloat16),    # 300 blocks: the last program runs part-full
    (64, 64, 64, False, torch.bfloat16),    # plain fp32 scales
    (40, 100, 128, True, torch.float16),     # another block size, fp16 out
    (33, 34, 64, True, torch.bfloat16),     # 1,122 values: the last block is part-full
    (520, 256, 64, True, torch.bfloat16),   # 2,080 blocks: more than one block of nested scales' 256
]


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter (numpy on the CPU) for kernels built in this test; compiled again after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _quantized(rows, cols, blocksize, nested, device):
    torch.manual_seed(rows * cols + blocksize)
    # Values over several orders of magnitude, as in a real weight's rows.
    w = (torch.randn(rows, cols) * torch.logspace(-3, 1, cols)).to(device=device, dtype=torch.bfloat16)
    return bnb_functional.quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=nested)


def _check(rows, cols, blocksize, nested, dtype, device):
    packed, state = _quantized(rows, cols, blocksize, nested, device)
    reference = bnb_functional.dequantize_4bit(packed, state).to(dtype)
    if dtype != state.dtype:  # bitsandbytes dequantizes to the dtype it quantized from
        state.dtype = dtype
        reference = bnb_functional.dequantize_4bit(packed, state)
    assert dequant.supports(state, dtype)
    out = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
    dequant.NF4Weight(state, torch.device(device))(packed, out)
    assert not torch.isnan(out).any(), "a value was never written"
    mismatch = (out != reference).sum().item()
    assert mismatch == 0, f"{mismatch} of {out.numel()} values differ from bitsandbytes'"


@pytest.mark.parametrize("rows,cols,blocksize,nested,dtype", CASES)
def test_the_kernel_gives_bitsandbytes_values_to_the_bit(interpreted, rows, cols, blocksize, nested, dtype):
    _check(rows, cols, blocksize, nested, dtype, "cpu")


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("rows,cols,first,values", [(6, 256, 0, 128), (6, 256, 128, 128), (4, 512, 192, 64)])
def test_a_window_of_the_weight_is_those_columns_of_the_whole(interpreted, rows, cols, first, values, nested):
    """A window (the same columns of every row; a mixture of experts' gate/up in halves) is, to the
    bit, those columns of the whole weight dequantized."""
    packed, state = _quantized(rows, cols, 64, nested, "cpu")
    kernel = dequant.NF4Weight(state, torch.device("cpu"))
    whole = torch.empty(rows, cols, dtype=torch.bfloat16)
    kernel(packed, whole)
    part = torch.full((rows, values), float("nan"), dtype=torch.bfloat16)
    kernel(packed, part, window=(cols, first, values))
    assert torch.equal(part, whole[:, first:first + values])


def test_what_the_kernel_does_not_cover_goes_to_bitsandbytes(monkeypatch):
    packed, state = _quantized(8, 64, 64, True, "cpu")
    assert dequant.supports(state, torch.bfloat16)
    assert not dequant.supports(state, torch.float32)
    _, fp4 = bnb_functional.quantize_4bit(torch.randn(8, 64, dtype=torch.bfloat16), quant_type="fp4")
    assert not dequant.supports(fp4, torch.bfloat16)
    # Compiled Triton needs a GPU: on the CPU only the interpreter runs it.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not dequant.available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dequant.available(torch.device("cpu"))


def test_the_interpreter_s_kernel_is_never_the_compiled_one(monkeypatch):
    """The kernel is kept per setting of TRITON_INTERPRET: one jitted under the interpreter (a CPU
    test in this process) must not be what a later call without it gets, or GPU tensors would be
    dequantized by the interpreter, which truncates to bf16 (the GPU tests failed so, run after
    the test above in one worker)."""
    if dequant._kernel() is None:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = dequant._kernel()
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = dequant._kernel()
    assert compiled is not interpreted
    assert type(compiled).__name__ == "JITFunction" and type(interpreted).__name__ != "JITFunction"


class Params4bit:
    """Stands in for bitsandbytes' 4-bit parameter (what frozen.is_4bit recognises: the type's name
    and a quant_state)."""

    def __init__(self, packed, state):
        self.data, self.quant_state, self.device = packed, state, packed.device


def _pieces(weights) -> torch.Tensor:
    """Every projection's weight of a FrozenWeights, stacked (each piece copied out of the workspace)."""
    return torch.cat([weights.piece(index).clone() for index in range(len(weights.bases))])


def test_the_fast_path_dequantizes_nf4_through_the_kernel(interpreted):
    """FrozenWeights picks the kernel for NF4 weights (and bitsandbytes with
    ``trainer.fast_path.kernels`` off): the weights are bitsandbytes' either way."""
    from types import SimpleNamespace

    from studio.engine.fast.frozen import FrozenWeights, Workspace

    bases, references = [], []
    for rows in (64, 96):
        packed, state = _quantized(rows, 128, 64, True, "cpu")
        bases.append(SimpleNamespace(weight=Params4bit(packed, state), in_features=128, out_features=rows))
        references.append(bnb_functional.dequantize_4bit(packed, state))
    workspace = Workspace()
    fast = FrozenWeights(bases, torch.bfloat16, workspace)
    plain = FrozenWeights(bases, torch.bfloat16, workspace, kernel=False)
    workspace.allocate(torch.bfloat16, torch.device("cpu"))
    assert all(k is not None for k in fast.kernels)
    assert torch.equal(_pieces(fast), torch.cat(references))
    assert all(k is None for k in plain.kernels)
    assert torch.equal(_pieces(plain), torch.cat(references))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,cols,blocksize,nested,dtype", [*CASES, (4096, 4096, 64, True, torch.bfloat16),
                                                              (11008, 4096, 64, True, torch.bfloat16)])
def test_compiled_on_the_gpu_the_kernel_gives_bitsandbytes_values_to_the_bit(rows, cols, blocksize, nested, dtype):
    _check(rows, cols, blocksize, nested, dtype, "cuda")


def test_a_kernel_that_fails_to_build_leaves_bitsandbytes_doing_the_work(interpreted, monkeypatch):
    """A Triton that cannot compile the kernel for this GPU must not stop training: the weight comes
    from bitsandbytes, with a warning that says why, and later weights skip the kernel."""
    from types import SimpleNamespace

    from studio.engine.fast.frozen import FrozenWeights, Workspace

    packed, state = _quantized(64, 128, 64, True, "cpu")
    base = SimpleNamespace(weight=Params4bit(packed, state), in_features=128, out_features=64)
    workspace = Workspace()
    fast = FrozenWeights([base], torch.bfloat16, workspace)
    workspace.allocate(torch.bfloat16, torch.device("cpu"))
    assert fast.kernels[0] is not None

    class Unbuildable:
        def __getitem__(self, grid):
            raise RuntimeError("PassManager::run failed")

    with monkeypatch.context() as patch:
        patch.setattr(dequant, "_kernel", lambda: Unbuildable())
        patch.setattr(dequant.KERNELS, "_broken", {})
        with pytest.warns(RuntimeWarning, match="PassManager::run failed"):
            matrix = _pieces(fast)
        assert torch.equal(matrix, bnb_functional.dequantize_4bit(packed, state))
        assert "PassManager" in dequant.broken()
        assert not dequant.available(torch.device("cpu"))
        assert FrozenWeights([base], torch.bfloat16, Workspace()).kernels == [None]
    assert dequant.broken() == ""
