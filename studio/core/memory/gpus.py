"""GPU cards Studio knows by size, and detection of the one in this machine through NVML.

Detection uses nvidia-ml-py (``pynvml``), which talks to the driver without torch; on a machine
without the package, the driver or a GPU it simply finds nothing. The VRAM pane and
``studio estimate`` use the capacities to say whether a run fits.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
"""Decimal gigabyte: card makers and nvidia-smi's marketing sizes use it."""

GIB = 2**30
"""Binary gibibyte: what the driver reports a card's memory in (an "80 GB" H100 has 79.6 GiB)."""


@dataclass(frozen=True)
class Gpu:
    """One card: a name and how many bytes of memory it has."""

    name: str
    """What a person calls it, e.g. ``NVIDIA T4 16 GB``."""

    capacity: int
    """Total device memory in bytes, as the driver reports it."""

    detected: bool = False
    """True when this card was found in this machine (not picked from the known list)."""

    @property
    def gb(self) -> float:
        """Capacity in decimal gigabytes, for display."""
        return self.capacity / GB


# Capacities as the driver reports them (total memory), so a fit check against a known card matches
# what the same card would report when detected. Figures from nvidia-smi on each card.
KNOWN_GPUS: tuple[Gpu, ...] = (
    Gpu("T4 16 GB", int(15.0 * GIB)),
    Gpu("L4 24 GB", int(22.5 * GIB)),
    Gpu("A10 24 GB", int(22.5 * GIB)),
    Gpu("RTX 4090 24 GB", int(23.99 * GIB)),
    Gpu("A100 40 GB", int(40.0 * GIB)),
    Gpu("L40S 48 GB", int(44.99 * GIB)),
    Gpu("A100 80 GB", int(80.0 * GIB)),
    Gpu("H100 80 GB", int(79.65 * GIB)),
    Gpu("H200 141 GB", int(140.4 * GIB)),
)
"""Cards a person can pick when the GPU is elsewhere (planning a run on a laptop)."""


def gpu_for_size(gb: float) -> Gpu:
    """The known card whose nominal size (the number in its name) is closest to ``gb``; a size no
    card has becomes an ad-hoc card of exactly that many decimal gigabytes."""
    for gpu in KNOWN_GPUS:
        nominal = float(gpu.name.rsplit(" ", 2)[-2])
        if abs(nominal - gb) < 0.5:
            return gpu
    return Gpu(f"{gb:g} GB", int(gb * GB))


def detect_gpus() -> list[Gpu]:
    """The GPUs of this machine, through NVML; an empty list when there is none or no driver.

    Never raises: a missing ``pynvml`` package, driver or GPU all mean "nothing detected".
    """
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError and OSError (no libnvidia-ml) both mean: no usable GPU here
        return []
    found: list[Gpu] = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):  # older bindings return bytes
                name = name.decode(errors="replace")
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            found.append(Gpu(str(name), int(memory.total), detected=True))
    except Exception:
        return found
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return found


def capacity_choices() -> list[Gpu]:
    """Detected cards first, then the known ones: what the VRAM pane offers."""
    return [*detect_gpus(), *KNOWN_GPUS]
