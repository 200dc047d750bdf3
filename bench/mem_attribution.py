"""Who holds the GPU memory at a run's peak: the allocator's history replayed, live blocks grouped
by the code that allocated them.

``record()`` starts the allocator's history with Python stacks; ``attribute()`` replays it, finds
the moment allocated memory peaked (and the moment the reserved mappings peaked), and groups the
blocks alive then by their first stack frame in a project we care about (studio, unsloth, peft,
transformers, bitsandbytes, liger, torch's graphs/checkpoint code), as a short JSON-able dict:

    {"peak_allocated": ..., "at_peak": [{"where": "studio/engine/fast/frozen.py:42 allocate",
                                          "bytes": ..., "blocks": ...}, ...],
     "peak_reserved": ..., "reserved_minus_allocated_at_reserved_peak": ...}

Used by bench/vram_accuracy.py for rows named in ``--trace`` (any engine).
"""

from __future__ import annotations

from collections import defaultdict

INTERESTING = ("studio/", "unsloth", "peft/", "transformers/", "bitsandbytes/", "liger_kernel/",
               "torch/utils/checkpoint", "torch/cuda/graphs", "torch/optim", "bench/")


def record() -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=2_000_000)


def _where(frames: list[dict]) -> str:
    for frame in frames or []:
        name = frame.get("filename", "")
        for key in INTERESTING:
            at = name.find(key)
            if at >= 0:
                short = name[at:]
                if key == "bench/" and "mem_attribution" in short:
                    continue
                return f"{short}:{frame.get('line', 0)} {frame.get('name', '')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').rsplit('/', 2)[-1]}:{f.get('line', 0)} {f.get('name', '')}"
    return "?"


def attribute(top: int = 30) -> dict:
    """Replay the recorded history (and stop recording); the peak's holders."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    live: dict[int, tuple[int, str]] = {}
    allocated = reserved = 0
    best_alloc = best_res = -1
    at_alloc: dict[int, tuple[int, str]] = {}
    gap_at_res = 0
    # Blocks alive before the history began (none if recording started before the load) are unknown.
    for e in events:
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            live[addr] = (size, _where(e.get("frames", [])))
            allocated += size
            if allocated > best_alloc:
                best_alloc = allocated
                at_alloc = dict(live)
        elif action in ("free_completed",):
            item = live.pop(addr, None)
            if item is not None:
                allocated -= item[0]
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
            if reserved > best_res:
                best_res = reserved
                gap_at_res = reserved - allocated
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_alloc.values():
        groups[where][0] += size
        groups[where][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_allocated_replayed": best_alloc, "peak_reserved_replayed": best_res,
            "reserved_minus_allocated_at_reserved_peak": gap_at_res, "events": len(events),
            "at_peak": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in ranked[:top]]}
