"""Read an allocator trace from bench/vram_accuracy.py --trace: where reserved-minus-allocated comes from.

For expandable-segment traces (``segment_map`` events) it splits the peaks by pool: the small pool
(tensors of at most 1 MiB) and the large pool each map one address range that never shrinks, so
peak reserved = large high-water + small high-water, and the gap to peak allocated is

    timing = small peak + large peak - peak of the sum   (the pools peak at different moments)
    frag   = each pool's high-water minus its own allocated peak (holes inside the mapping)

For every trace it also finds the 32 MiB cuBLAS workspaces (allocated once, never freed) and prints
what they landed in: the hole (expandable) or the segment (fixed segments) and its size.

    python bench/trace_pools.py bench/results/archive/traces/*.json.gz

These are the numbers bench/NOTES.md quotes for the expandable-segments model in studio/core/memory/plain.py.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from pathlib import Path

SMALL = 2**20  # the allocator's small pool takes requests up to 1 MiB
PAGE = 2 * 2**20  # mappings are made of 2 MiB pages
WORKSPACE = 32 * 2**20
GB = 1e9


def load(path: Path) -> list[list]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _pool_of_maps(events: list[list]) -> dict[int, str]:
    """Which pool each mapping belongs to: the one whose allocations' address range is nearest."""
    spans: dict[str, list[int]] = {}
    for action, addr, size, _ in events:
        if action == "alloc":
            pool = "small" if size <= SMALL else "large"
            lo, hi = spans.setdefault(pool, [addr, addr])
            spans[pool] = [min(lo, addr), max(hi, addr + size)]

    def distance(addr: int, span: list[int]) -> int:
        return 0 if span[0] <= addr <= span[1] else min(abs(addr - span[0]), abs(addr - span[1]))

    return {i: min(spans, key=lambda p: distance(addr, spans[p]))
            for i, (action, addr, _, _) in enumerate(events) if action in ("segment_map", "segment_unmap")}


def pools(events: list[list]) -> dict:
    """Per-pool allocated peak and mapped high-water, and the overall peaks (expandable traces)."""
    owner = _pool_of_maps(events)
    pages = {"small": set(), "large": set()}
    high = {"small": 0, "large": 0}
    alloc = {"small": 0, "large": 0}
    peak = {"small": 0, "large": 0}
    sizes: dict[int, int] = {}
    total_peak = 0
    for i, (action, addr, size, _) in enumerate(events):
        if action in ("segment_map", "segment_unmap"):
            span = range(addr // PAGE, (addr + size) // PAGE)
            if action == "segment_map":
                pages[owner[i]].update(span)
                high[owner[i]] = max(high[owner[i]], len(pages[owner[i]]) * PAGE)
            else:
                pages[owner[i]].difference_update(span)
        elif action == "alloc":
            pool = "small" if size <= SMALL else "large"
            sizes[addr] = size
            alloc[pool] += size
            peak[pool] = max(peak[pool], alloc[pool])
            total_peak = max(total_peak, alloc["small"] + alloc["large"])
        elif action == "free_completed" and addr in sizes:
            alloc["small" if sizes.pop(addr) <= SMALL else "large"] -= size
    return {"reserved": high["small"] + high["large"], "allocated": total_peak,
            "timing": peak["small"] + peak["large"] - total_peak,
            "frag_large": high["large"] - peak["large"], "frag_small": high["small"] - peak["small"]}


def workspaces(events: list[list]) -> list[tuple[int, int, str]]:
    """(event index, size of what it landed in, 'hole'|'segment') for each never-freed block of
    32-40 MiB allocated after the first 5% of the trace (the backward thread's cuBLAS workspace)."""
    freed = set()
    last_alloc: dict[int, int] = {}
    for i, (action, addr, _, _) in enumerate(events):
        if action == "alloc":
            last_alloc[addr] = i
        elif action == "free_completed" and addr in last_alloc:
            freed.add(last_alloc.pop(addr))
    wanted = {i for i, (action, _, size, _) in enumerate(events)
              if action == "alloc" and i not in freed and WORKSPACE <= size <= 40 * 2**20
              and i > len(events) // 20}
    found = []
    live: dict[int, int] = {}
    segments: list[tuple[int, int]] = []
    pages: set[int] = set()
    for i, (action, addr, size, _) in enumerate(events):
        if i in wanted:
            if segments:  # fixed segments: the segment that holds it
                j = bisect.bisect_right(segments, (addr, float("inf"))) - 1
                found.append((i, segments[j][1], "segment"))
            else:  # one mapping: the free run of bytes around it
                found.append((i, _hole_around(addr, live, pages), "hole"))
        if action == "segment_alloc":
            bisect.insort(segments, (addr, size))
        elif action == "segment_free":
            segments.remove((addr, size))
        elif action == "segment_map":
            pages.update(range(addr // PAGE, (addr + size) // PAGE))
        elif action == "segment_unmap":
            pages.difference_update(range(addr // PAGE, (addr + size) // PAGE))
        elif action == "alloc":
            live[addr] = size
        elif action == "free_completed":
            live.pop(addr, None)
    return found


def _hole_around(addr: int, live: dict[int, int], pages: set[int]) -> int:
    """Bytes of mapped, unallocated memory in the run containing ``addr``."""
    ends = sorted((a, a + s) for a, s in live.items())
    starts = [a for a, _ in ends]
    k = bisect.bisect_right(starts, addr)
    lo = ends[k - 1][1] if k else 0
    hi = starts[k] if k < len(starts) else None
    lo = max(lo, _mapped_edge(addr, pages, -1))
    edge = _mapped_edge(addr, pages, +1)
    return (edge if hi is None else min(hi, edge)) - lo


def _mapped_edge(addr: int, pages: set[int], step: int) -> int:
    page = addr // PAGE
    while page + step in pages:
        page += step
    return page * PAGE if step < 0 else (page + 1) * PAGE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.traces:
        events = load(path)
        print(path.name)
        if any(e[0] == "segment_map" for e in events):
            p = pools(events)
            print(f"  reserved {p['reserved'] / GB:.3f} GB, allocated {p['allocated'] / GB:.3f} GB: "
                  f"timing {p['timing'] / GB:.3f} + holes large {p['frag_large'] / GB:.3f}, "
                  f"small {p['frag_small'] / GB:.3f}")
        for i, size, kind in workspaces(events):
            print(f"  workspace at event {i} landed in a {size / 1e6:.1f} MB {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
