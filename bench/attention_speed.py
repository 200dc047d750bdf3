"""Soft-capped and sink attention: Studio's fused Triton kernels against EagerAttention, forward + backward.

engine/fast/attention.py's ``attend`` for one layer's q, k and v (bf16, the way a training step
calls it), once with ``fused=True`` (engine/fast/fused_attention.py) and once without (EagerAttention,
plain torch, a block of queries at a time, the scores recomputed in the backward), at the shapes of
the two families that need it:

- ``gemma-2-9b``: 16 heads, 8 key/value heads, 256 wide, scores capped at 50, scale 1/sqrt(224);
  a 4096-token window on every other layer (``_window``), which hides nothing at 2048 tokens;
- ``gpt-oss-20b``: 64 heads, 8 key/value heads, 64 wide, a sink per head; a 128-token window on
  every other layer (``_window``).

Each in two layouts: ``row`` (one example the whole row) and ``packed`` (the row cut into examples
of a quarter of it, boundaries on the device, as a CUDA-graphed step gives them). For each: the
milliseconds of a forward + backward (best of repeats), of the same replayed as a CUDA graph, the
peak memory allocated beyond the inputs, the first call's seconds (the kernels' compile, Triton's
cache emptied beforehand: what a user waits for at a run's first step), and the fused output's and
gradients' relative distance from EagerAttention's. ``--sweep`` times each pass's tiles
(fused_attention.TILES) one pass at a time. ``--tiny``: small shapes on the CPU under Triton's
interpreter (the tests check the script that way; no timings worth reading).

    python bench/attention_speed.py --out $OUT/attention_speed.json --commit <sha> [--tokens 2048,8192] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.families import _commit  # noqa: E402

SHAPES = {
    # name: (heads, kv_heads, head_dim, scale, window, softcap, sinks)
    "gemma-2-9b": (16, 8, 256, 224 ** -0.5, None, 50.0, False),
    "gemma-2-9b_window": (16, 8, 256, 224 ** -0.5, 4096, 50.0, False),
    "gpt-oss-20b": (64, 8, 64, None, None, None, True),
    "gpt-oss-20b_window": (64, 8, 64, None, 128, None, True),
}
TINY = {"gemma-2-9b": (4, 2, 32, 0.2, None, 5.0, False), "gpt-oss-20b_window": (4, 1, 16, None, 8, None, True)}
"""``--tiny``'s shapes (the CPU, under the interpreter): the same traits, a few heads."""

SWEEP = {
    "forward": ((128, 64, 8, 2), (128, 64, 4, 3), (64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 8, 2),
                (32, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2)),
    "dq": ((128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2),
           (32, 32, 8, 2), (32, 32, 4, 2)),
    "dkdv": ((64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 2),
             (32, 32, 8, 2), (32, 32, 4, 2)),
}
"""The tiles ``--sweep`` tries for each pass (queries a block, keys a block, warps, stages)."""



def _inputs(shape: tuple, tokens: int, packed: bool, device, dtype):
    """q, k, v (leaves that take gradients), the output's gradient, the sinks and the Segments."""
    import torch

    from studio.engine.fast.attention import Segments

    heads, kv_heads, head_dim, _, _, _, sinks = shape
    gen = torch.Generator(device=device).manual_seed(tokens + heads)
    q = (3 * torch.randn(1, tokens, heads, head_dim, generator=gen, device=device)).to(dtype).requires_grad_()
    k = torch.randn(1, tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype).requires_grad_()
    v = torch.randn(1, tokens, kv_heads, head_dim, generator=gen, device=device).to(dtype).requires_grad_()
    dout = torch.randn(1, tokens, heads, head_dim, generator=gen, device=device).to(dtype)
    sink = 2 * torch.randn(heads, generator=gen, device=device) if sinks else None
    if packed:
        cu = torch.tensor([0, tokens // 4, tokens // 2, 3 * tokens // 4, tokens], dtype=torch.int32, device=device)
        return (q, k, v), dout, sink, Segments(cu=cu, max_len=tokens)
    return (q, k, v), dout, sink, Segments()


def _step(leaves, dout, sink, seg, span, fused: bool):
    """One forward + backward of ``attend`` (the gradients set, not added)."""
    from studio.engine.fast.attention import attend

    for x in leaves:
        x.grad = None
    out = attend(*leaves, seg, None, span, sink, fused=fused)
    out.backward(dout)
    return out


def _graph_ms(fn, timer) -> float | None:
    """Milliseconds of ``fn`` replayed as a CUDA graph (warmed on a side stream first), or None when
    the capture fails."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - reported, the eager timing stands
        print(f"  capture failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    ms = timer(graph.replay)
    del graph
    return ms


def _measure(name: str, shape: tuple, tokens: int, packed: bool, device, cuda: bool, graphs: bool) -> dict:
    import torch

    from studio.engine.fast import fused_attention
    from studio.engine.fast.attention import Span

    heads, kv_heads, head_dim, scale, window, softcap, _ = shape
    span = Span(scale=scale, window=window, softcap=softcap)
    leaves, dout, sink, seg = _inputs(shape, tokens, packed, device, torch.bfloat16)
    row: dict = {"shape": name, "tokens": tokens, "layout": "packed" if packed else "row", "heads": heads,
                 "kv_heads": kv_heads, "head_dim": head_dim, "window": window, "softcap": softcap,
                 "sinks": sink is not None}
    outputs = {}
    for way, fused in (("eager", False), ("fused", True)):
        if fused and not fused_attention.available(device, torch.bfloat16, head_dim):
            row[way] = {"skipped": f"not available here ({fused_attention.broken() or 'no CUDA or Triton'})"}
            continue
        result = {}
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _step(leaves, dout, sink, seg, span, fused)
        if cuda:
            torch.cuda.synchronize()
        result["first_call_s"] = round(time.perf_counter() - start, 2)
        outputs[way] = [_step(leaves, dout, sink, seg, span, fused).detach().float()] + [
            x.grad.float() for x in leaves]
        if cuda:
            from bench.gpu_timing import best_ms

            def timer(fn):
                return round(best_ms(fn, loops=5, repeats=5), 3)
            result["ms"] = timer(lambda fused=fused: _step(leaves, dout, sink, seg, span, fused))
            for x in leaves:
                x.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(leaves, dout, sink, seg, span, fused)
            torch.cuda.synchronize()
            result["peak_mib_beyond_inputs"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            if graphs:
                for x in leaves:
                    x.grad = None
                result["graph_ms"] = _graph_ms(lambda fused=fused: _step(leaves, dout, sink, seg, span, fused), timer)
        else:
            start = time.perf_counter()
            _step(leaves, dout, sink, seg, span, fused)
            result["ms"] = round((time.perf_counter() - start) * 1000, 1)
        row[way] = result
        print(f"{name} {row['layout']} T={tokens} {way}: {result}", flush=True)
    if len(outputs) == 2:
        row["fused_vs_eager_rel"] = {
            part: round(((f - e).norm() / e.norm()).item(), 5)
            for part, f, e in zip(("out", "dq", "dk", "dv"), outputs["fused"], outputs["eager"], strict=True)}
        if cuda:
            row["speedup"] = round(row["eager"]["ms"] / row["fused"]["ms"], 2)
            eager_g, fused_g = row["eager"].get("graph_ms"), row["fused"].get("graph_ms")
            if eager_g and fused_g:
                row["graph_speedup"] = round(eager_g / fused_g, 2)
    return row


def _sweep(name: str, shape: tuple, tokens: int, device) -> dict:
    """Each pass's tiles of :data:`SWEEP`, one pass at a time, the others at their first (the
    engine's) tile: milliseconds of a forward + backward, or why the tile did not run."""
    import torch

    from bench.gpu_timing import best_ms
    from studio.engine.fast import fused_attention
    from studio.engine.fast.attention import Span

    heads, kv_heads, head_dim, scale, window, softcap, _ = shape
    span = Span(scale=scale, window=window, softcap=softcap)
    leaves, dout, sink, seg = _inputs(shape, tokens, True, device, torch.bfloat16)
    block_d = fused_attention._block_d(head_dim)
    chosen = {step: tiles[block_d] for step, tiles in fused_attention.TILES.items()}
    found: dict = {}
    for step, candidates in SWEEP.items():
        found[step] = {}
        for tile in candidates:
            fused_attention.TILES[step][block_d] = (tile,)
            fused_attention._chosen.clear()
            key = "x".join(str(n) for n in tile)
            try:
                found[step][key] = round(best_ms(lambda: _step(leaves, dout, sink, seg, span, True), loops=5), 3)
            except Exception as exc:  # noqa: BLE001 - a tile too large for the card: recorded
                found[step][key] = f"{type(exc).__name__}: {str(exc)[:120]}"
            torch.cuda.synchronize()
            if fused_attention.broken():  # the engine gave the kernels up (that time was the eager one's)
                found[step][key] = f"gave up: {fused_attention.broken()[:120]}"
                fused_attention.KERNELS._broken.clear()  # the next tile gets its own chance
        fused_attention.TILES[step][block_d] = chosen[step]
        fused_attention._chosen.clear()
        timed = {k: v for k, v in found[step].items() if isinstance(v, float)}
        if timed:
            best = min(timed, key=timed.get)
            print(f"{name} sweep {step}: best {best} {timed[best]} ms (engine's {chosen[step][0]})", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", help="the commit this tree is (default: git rev-parse HEAD, stale on the GPU box)")
    parser.add_argument("--tokens", default="2048", help="comma-separated stream lengths")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays")
    parser.add_argument("--sweep", action="store_true", help="also time each pass's tiles (packed, first length)")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU under Triton's interpreter")
    args = parser.parse_args(argv)

    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    # an empty cache, so that the first call's seconds are the kernels' compile a fresh install pays
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attention_speed_triton_")
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        parser.error("needs a CUDA GPU (or --tiny)")
    device = torch.device("cuda" if cuda else "cpu")
    shapes = TINY if args.tiny else {n: SHAPES[n] for n in args.shapes.split(",")}
    lengths = [48] if args.tiny else [int(t) for t in args.tokens.split(",")]
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report: dict = {"what": __doc__.splitlines()[0], "command": " ".join(shlex.quote(a) for a in [sys.executable,
                                                                                                     *sys.argv]),
                    "commit": _commit(args.commit), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                    "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                 "triton": triton_version},
                    "rows": []}
    from studio.engine.fast import fused_attention

    report["tiles"] = {step: {str(d): [list(t) for t in tiles] for d, tiles in by_width.items()}
                       for step, by_width in fused_attention.TILES.items()}
    started = time.perf_counter()

    def write() -> None:  # after every row: a call cut short keeps what it measured
        report["tiles_settled"] = {f"{step}/{width}": index for (step, width), index in fused_attention._chosen.items()}
        report["wall_s"] = round(time.perf_counter() - started, 1)
        report["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    for tokens in lengths:
        for name, shape in shapes.items():
            for packed in (False, True):
                report["rows"].append(_measure(name, shape, tokens, packed, device, cuda, not args.no_graphs))
                write()
    if args.sweep and cuda:
        report["sweep_ms"] = {}
        for name, shape in shapes.items():
            report["sweep_ms"][name] = _sweep(name, shape, lengths[0], device)
            write()
    write()
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
