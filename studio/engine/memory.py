"""Measure where the memory of a live model goes, in the estimator's categories.

``measure_memory(model, optimizer, device)`` returns bytes for weights, lora, gradients, optimizer,
activations and overhead, the same keys core/memory/ predicts, so the gauge can draw both side by
side. Weights include what bitsandbytes keeps beside the packed data (quantization constants,
int8 row scales), which are not parameters and which ``model.parameters()`` alone misses.

On CUDA, activations are the peak allocated since the last ``reset_peak`` minus everything else
(parameters, gradients, optimizer state): the saved tensors and temporaries of the step. Overhead is
peak reserved minus peak allocated (memory torch's caching allocator holds but does not use) plus
the CUDA context and library handles, which are outside torch's counters: this process's memory on
the card as the driver reports it (nvidia-ml-py), less torch's reserved. Where the driver does not
list the process (some containers) that part is left out. On CPU both are 0.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from studio.core.decoder.spec import EXPERT_PARAMETERS
from studio.engine.mxfp4 import mxfp4_experts
from studio.engine.quantized_experts import packed_experts


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identity of the memory behind a tensor, so views and shared tensors count once."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.numel() and 0 in tensor.stride():  # broadcast (a packed expert weight's placeholder)
        return tensor.untyped_storage().nbytes()
    return tensor.numel() * tensor.element_size()


def _quant_state_tensors(param: torch.Tensor) -> list[torch.Tensor]:
    """Tensors bitsandbytes keeps beside a quantized weight: 4-bit absmax (nested too) and codes,
    8-bit row scales."""
    found: list[torch.Tensor] = []
    state = getattr(param, "quant_state", None)
    while state is not None:
        for name in ("absmax", "code", "offset"):
            value = getattr(state, name, None)
            if torch.is_tensor(value):
                found.append(value)
        state = getattr(state, "state2", None)
    scb = getattr(param, "SCB", None)
    if torch.is_tensor(scb):
        found.append(scb)
    return found


def _is_adapter(name: str) -> bool:
    return "lora_" in name


def parameter_bytes(model: Any) -> dict[str, int]:
    """Bytes of frozen base weights (with quantization constants and buffers), of a mixture of
    experts' expert weights (``experts``: packed in 4 bits, MXFP4 or not), of adapter weights, and of
    gradients. Parameters that train without being adapters (full fine-tuning) count as weights.

    Gradients: the ``.grad`` tensors when they exist; between steps (``zero_grad(set_to_none=True)``)
    they are freed, so the bytes they take during backward (one per trainable element, in the
    parameter's dtype) are reported instead.
    """
    seen: set[tuple[str, int]] = set()
    weights = lora = grads = 0

    def add(tensor: torch.Tensor) -> int:
        key = _storage_key(tensor)
        if key in seen or tensor.numel() == 0:
            return 0
        seen.add(key)
        return _nbytes(tensor)

    for name, param in model.named_parameters():
        size = add(param)
        if _is_adapter(name):
            lora += size
        else:
            weights += size
            for extra in _quant_state_tensors(param):
                weights += add(extra)
        if param.requires_grad:
            grads += _nbytes(param.grad) if param.grad is not None else _nbytes(param)
    for buffer in model.buffers():
        weights += add(buffer)
    experts = 0
    for module in model.modules():  # 4-bit experts (engine/quantized_experts.py): not parameters
        for packed in packed_experts(module).values():
            experts += add(packed.packed) + sum(add(t) for t in _quant_state_tensors(packed))
        for stored in mxfp4_experts(module).values():  # gpt-oss' MXFP4 experts (engine/mxfp4.py)
            experts += add(stored.blocks) + add(stored.scales)
    for name, param in model.named_parameters():  # 16-bit experts: their own category too
        if name.rsplit(".", 1)[-1] in EXPERT_PARAMETERS and param.dim() == 3 and not _is_adapter(name):
            size = _nbytes(param)
            weights -= size
            experts += size
    return {"weights": weights, "experts": experts, "lora": lora, "gradients": grads}


def optimizer_bytes(optimizer: Any, device: torch.device | None = None) -> tuple[int, int]:
    """(bytes of optimizer state, of which paged): every tensor in ``optimizer.state``.

    Scalars (step counters) and tensors on another device than ``device`` are left out.
    bitsandbytes' paged state lives in CUDA unified memory, outside torch's allocator counters.
    """
    if optimizer is None:
        return 0, 0
    seen: set[tuple[str, int]] = set()
    total = paged = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue  # scalars are step counters (on the CPU for torch's AdamW on a GPU)
            if device is not None and value.device.type != device.type:
                continue
            key = _storage_key(value)
            if key in seen:
                continue
            seen.add(key)
            total += _nbytes(value)
            if getattr(value, "is_paged", False):
                paged += _nbytes(value)
    return total, paged


_NVML: Any = None  # the initialised pynvml module, False once it failed, None before the first try


def _nvml() -> Any:
    """pynvml, initialised once per process (the training loop asks every logged step)."""
    global _NVML
    if _NVML is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:  # noqa: BLE001 - no package, no driver, no GPU: "cannot say"
            _NVML = False
    return _NVML


def process_gpu_bytes(pid: int | None = None) -> int | None:
    """Device memory the driver charges to this process, over all GPUs; None if it cannot say
    (no nvidia-ml-py, no driver, or a PID namespace that hides the process from NVML)."""
    nvml = _nvml()
    if not nvml:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        used, found = 0, False
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    used, found = used + int(proc.usedGpuMemory), True
        return used if found else None
    except Exception:  # noqa: BLE001
        return None


def context_bytes(device: torch.device) -> int:
    """What this process holds on the card beyond torch's reserved pool (CUDA context, cuBLAS and
    cuDNN handles, kernels' modules); 0 when the driver cannot say."""
    used = process_gpu_bytes()
    if used is None:
        return 0
    return max(0, used - torch.cuda.memory_reserved(device))


def allocator_counters(device: torch.device) -> dict[str, int]:
    """torch's allocated and reserved bytes on ``device`` and their peaks, from one reading of the
    allocator's statistics (each of ``torch.cuda.memory_allocated`` and its kin builds the whole
    statistics table again: a sample taken between two steps is time the GPU waits)."""
    stats = torch.cuda.memory_stats(device)
    return {"allocated": stats.get("allocated_bytes.all.current", 0),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
            "peak_reserved": stats.get("reserved_bytes.all.peak", 0)}


def measure_memory(model: Any, optimizer: Any, device: torch.device | str | None,
                   params: dict[str, int] | None = None, context: int | None = None,
                   counters: dict[str, int] | None = None,
                   optim: tuple[int, int] | None = None) -> dict[str, int]:
    """Bytes by category on the live model: weights, lora, gradients, optimizer, activations,
    overhead (the keys of :data:`studio.core.memory.CATEGORIES`).

    Call it after a training step; ``reset_peak(device)`` before the step makes activations that
    step's peak rather than the run's. ``params`` (:func:`parameter_bytes`), ``context``
    (:func:`context_bytes`) and ``optim`` (:func:`optimizer_bytes`) may come from an earlier call:
    they are the same step after step. ``counters``: :func:`allocator_counters`, read now if not given.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    params = parameter_bytes(model) if params is None else params
    optim, paged = optimizer_bytes(optimizer, device) if optim is None else optim
    activations = overhead = 0
    if device.type == "cuda" and torch.cuda.is_available():
        counters = allocator_counters(device) if counters is None else counters
        peak_allocated, peak_reserved = counters["peak_allocated"], counters["peak_reserved"]
        # paged optimizer state is not in torch's counters, so it is not subtracted from them
        resident = params["weights"] + params.get("experts", 0) + params["lora"] + params["gradients"] + optim - paged
        activations = max(0, peak_allocated - resident)
        # the driver also charges the process for paged (unified-memory) state living on the card,
        # which the optimizer category already holds
        context = context_bytes(device) if context is None else context
        overhead = max(0, peak_reserved - peak_allocated) + max(0, context - paged)
    return {"weights": params["weights"], "experts": params.get("experts", 0), "lora": params["lora"],
            "gradients": params["gradients"],
            "optimizer": optim, "activations": activations, "overhead": overhead}


def device_totals(device: torch.device | str | None, counters: dict[str, int] | None = None) -> dict[str, int]:
    """Allocator totals for MemorySampled: allocated, reserved, their peaks (``counters``, read now
    if not given), and the card's capacity (all 0 off CUDA)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0, "peak_reserved": 0, "capacity": 0}
    counters = allocator_counters(device) if counters is None else counters
    return {**counters, "capacity": torch.cuda.get_device_properties(device).total_memory}


def reset_peak(device: torch.device | str | None) -> None:
    """Start a new peak window (no-op off CUDA)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def sample(model: Any, optimizer: Any, device: torch.device | None, step: int, rank: int = 0,
           params: dict[str, int] | None = None, context: int | None = None,
           optim: tuple[int, int] | None = None) -> Any:
    """A MemorySampled event for ``device`` now: the categories of :func:`measure_memory` and the
    allocator's totals, from one reading of its counters (on the CPU, which has no allocator
    counters, what the model and optimizer hold stands for every total). ``rank``: which process
    of a data-parallel run it comes from; ``params``, ``context`` and ``optim``: as
    :func:`measure_memory` takes them."""
    from studio.core import events as ev

    cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
    counters = allocator_counters(device) if cuda else None
    categories = measure_memory(model, optimizer, device, params, context, counters, optim)
    if cuda:
        totals = device_totals(device, counters)
        name = torch.cuda.get_device_name(device)
    else:
        held = sum(categories.values())
        totals = {"allocated": held, "reserved": held, "peak_allocated": held, "peak_reserved": held,
                  "capacity": 0}
        name = "cpu"
    return ev.MemorySampled(step=step, device=name, categories=categories, rank=rank, **totals)


class MemorySampler:
    """:func:`sample` for every step of one training run, at a cost the step does not notice.

    The host's work between two steps is time the GPU waits (the step's figures are read at its
    end). Walking a 7B model's parameters takes milliseconds and gives the same bytes every step,
    so it is done once; the optimizer's state is walked again only when it holds another number of
    parameters' state (it is made at the first step and keeps its sizes); the driver's count of the
    process's memory (an NVML query) is asked at most every ``context_every_s`` seconds, since the
    context and library handles it adds to torch's reserved memory change rarely. The allocator's
    counters are read every time, once.
    """

    def __init__(self, model: Any, device: torch.device | None, rank: int = 0, context_every_s: float = 5.0,
                 clock: Any = time.monotonic):
        self.model, self.device, self.rank = model, device, rank
        self.context_every_s = context_every_s
        self.clock = clock
        self._params: dict[str, int] | None = None
        self._context: tuple[float, int] | None = None
        """(when it was asked, bytes)"""
        self._optim: tuple[tuple[int, int], tuple[int, int]] | None = None
        """((id of the optimizer, parameters with state), its :func:`optimizer_bytes`)"""

    def __call__(self, optimizer: Any, step: int) -> Any:
        if self._params is None:
            self._params = parameter_bytes(self.model)
        key = (id(optimizer), len(optimizer.state) if optimizer is not None else 0)
        if self._optim is None or self._optim[0] != key:
            self._optim = (key, optimizer_bytes(optimizer, self.device))
        context = None
        if self.device is not None and self.device.type == "cuda":
            now = self.clock()
            if self._context is None or now - self._context[0] >= self.context_every_s:
                self._context = (now, context_bytes(self.device))
            context = self._context[1]
        return sample(self.model, optimizer, self.device, step, self.rank, self._params, context, self._optim[1])
