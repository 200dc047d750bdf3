"""How many GPUs a run trains on, and which: ``distributed.gpus`` against this machine's cards.

Plain Python (no torch): the launcher, ``studio estimate`` and the UI decide this before
anything heavy is imported. The cards are counted from the NVIDIA driver's ``/proc`` entries and
narrowed by ``CUDA_VISIBLE_DEVICES`` as CUDA narrows them (NVML or ``nvidia-smi -L`` where a container
hides those entries).
"""

from __future__ import annotations

import os
from pathlib import Path

from studio.core.config import RunConfig

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
"""One folder per card the NVIDIA driver manages."""

CPU_PROCESSES_ENV = "STUDIO_DISTRIBUTED_CPU"
"""Set to 1 to let ``gpus: N`` start N processes on the CPU (gloo): the tests' way to run the
multi-process path on a machine without GPUs. Without it a CPU machine refuses ``gpus`` > 1."""


class GpuCountError(ValueError):
    """``distributed.gpus`` asks for more GPUs than this process can see; the message says what to do."""


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may use, by the names ``CUDA_VISIBLE_DEVICES`` gives them (indices, or
    UUIDs), or ``0..n-1`` for the driver's n cards; empty without an NVIDIA driver."""
    present = _driver_gpu_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(present)]
    ids: list[str] = []
    for item in visible.split(","):
        item = item.strip()
        # CUDA stops at the first entry it cannot use: an empty one, or -1.
        if not item or item == "-1" or (item.isdigit() and int(item) >= present):
            break
        ids.append(item)
    return ids if present else []


def _driver_gpu_count() -> int:
    """The NVIDIA driver's cards: its /proc folders, else NVML (a container may hide /proc's), else
    ``nvidia-smi -L``; 0 without a driver."""
    if DRIVER_GPUS.is_dir():
        return len(list(DRIVER_GPUS.iterdir()))
    from studio.core.memory.gpus import detect_gpus

    found = detect_gpus()
    if found:
        return len(found)
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def cpu_processes_allowed() -> bool:
    """Whether ``gpus: N`` may mean N CPU processes here (tests only; see CPU_PROCESSES_ENV)."""
    return os.environ.get(CPU_PROCESSES_ENV) == "1"


def requested_gpus(config: RunConfig, visible: list[str] | None = None) -> int:
    """How many processes ``config`` trains with: ``distributed.gpus``, ``all`` counted on this
    machine (1 without GPUs). Not checked against the machine: see :func:`plan_devices`."""
    spec = config.distributed.gpus
    if spec == "all":
        return max(1, len(visible_gpu_ids() if visible is None else visible))
    return int(spec)


def plan_devices(config: RunConfig, visible: list[str] | None = None) -> list[str]:
    """The device lock keys of the run's processes: one GPU id each, or ``cpu`` repeated when CPU
    processes are allowed. Raises GpuCountError when the machine has fewer GPUs than asked for."""
    visible = visible_gpu_ids() if visible is None else visible
    wanted = requested_gpus(config, visible)
    if wanted <= 1:
        return visible[:1] or ["cpu"]
    if wanted <= len(visible):
        return visible[:wanted]
    if not visible and cpu_processes_allowed():
        return ["cpu"] * wanted
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{len(visible)} GPU{'s' if len(visible) != 1 else ''}" + \
        (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
    fix = f"use --gpus {len(visible)} (or distributed.gpus: all)" if len(visible) > 1 else \
        "use --gpus 1 (or remove distributed.gpus)"
    raise GpuCountError(f"{wanted} GPUs asked for, but this machine shows {seen}; {fix}")
