"""engine/fast/update.py's kernels against what they replace, on a 7B layer's shapes.

Times, at micro-batch 16 x seq 512 (8192 tokens) and 4096 tokens, rank 16:
- gate/up: the LoRA update's own product writing the 2 x 11008-wide output (``addmm_`` with beta 0,
  as products.LoraProduct runs it) plus liger's SwiGLU, against Studio's SwiGLU adding the update
  inside (forward), and liger's SwiGLU backward against Studio's (which adds the update again);
- o/down: the update's product plus the residual's add against the one kernel;
- the layer's norms (engine/fast/norm.py): liger's RMSNorm forward against Studio's, and liger's
  backward plus autograd's add of the stream's gradient against Studio's one backward pass;
- a sweep of the kernels' tile shapes and warps (``--sweep``).
The base products are left out: both orders run them, with or without reading the output.

    python3 bench/update_kernels.py --out bench/results/current/x.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_timing import best_ms  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="8192,4096")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()

    import torch
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import swiglu_fused_gate_up_backward, swiglu_fused_gate_up_forward

    from studio.engine.fast import norm, update

    dev, bf = torch.device("cuda"), torch.bfloat16
    hidden, ffn, rank, scale = 4096, 11008, 16, 2.0

    def timed(fn) -> float:
        return round(best_ms(fn, loops=20, repeats=5) * 1000, 1)  # microseconds

    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__}, "us": {}}
    t0 = time.perf_counter()
    for m in (int(t) for t in args.tokens.split(",")):
        gu = torch.randn(m, 2 * ffn, device=dev, dtype=bf)
        xa = torch.randn(m, 2 * rank, device=dev, dtype=bf)
        bt = torch.zeros(2 * rank, 2 * ffn, device=dev, dtype=bf)
        bt[:rank, :ffn] = 0.01 * torch.randn(rank, ffn, device=dev)
        bt[rank:, ffn:] = 0.01 * torch.randn(rank, ffn, device=dev)
        dout = torch.randn(m, ffn, device=dev, dtype=bf)
        split = (0, rank, rank, rank)  # gate's rows of B^T's block diagonal, then up's
        y = torch.empty_like(gu)
        r = {
            "gate_up/update_product_bz": timed(lambda: y.addmm_(xa, bt, beta=0, alpha=scale)),
            "gate_up/liger_swiglu_forward": timed(lambda: swiglu_fused_gate_up_forward(gu)),
            "gate_up/studio_swiglu_forward_with_update": timed(lambda: update.gated(gu, xa, bt, scale, split)),
            "gate_up/studio_swiglu_forward_no_update": timed(lambda: update.gated(gu, None, None, 1.0)),
            "gate_up/liger_swiglu_backward_in_place": timed(lambda: swiglu_fused_gate_up_backward(gu, dout, True)),
            "gate_up/studio_swiglu_backward_with_update": timed(
                lambda: update.gated_backward_(gu, xa, bt, scale, dout, split)),
            "gate_up/studio_swiglu_backward_no_update": timed(
                lambda: update.gated_backward_(gu, None, None, 1.0, dout)),
        }
        ys = torch.randn(m, hidden, device=dev, dtype=bf)
        res = torch.randn(m, hidden, device=dev, dtype=bf)
        xa1 = torch.randn(m, rank, device=dev, dtype=bf)
        bt1 = 0.01 * torch.randn(rank, hidden, device=dev, dtype=bf)

        def old_residual():
            ys.addmm_(xa1, bt1, beta=0, alpha=scale)  # the update's product (the base adds itself after)
            ys.add_(res)

        r["o_down/update_product_bz_plus_add"] = timed(old_residual)
        r["o_down/studio_update_and_residual"] = timed(
            lambda: update.add_update_and_residual_(ys, xa1, bt1, scale, res))
        w = 1 + 0.1 * torch.randn(hidden, device=dev, dtype=bf)
        h = torch.randn(m, hidden, device=dev, dtype=bf, requires_grad=True)
        dx_in = torch.randn(m, hidden, device=dev, dtype=bf)
        liger_out = LigerRMSNormFunction.apply(h, w, 1e-5, 0.0, "llama", True)
        _, rstd = norm.rms_norm(h.detach(), w, 1e-5)

        def liger_backward_and_add():
            # liger's backward (in place over a fresh copy of the incoming gradient, as the engine
            # called it), then the add autograd ran for the stream's share
            grad = torch.autograd.grad(liger_out, h, dx_in.clone(), retain_graph=True)[0]
            return grad + res

        r["norm/liger_forward"] = timed(lambda: LigerRMSNormFunction.apply(h.detach(), w, 1e-5, 0.0, "llama", True))
        r["norm/studio_forward"] = timed(lambda: norm.rms_norm(h.detach(), w, 1e-5))
        r["norm/liger_backward_plus_add"] = timed(liger_backward_and_add)
        r["norm/studio_backward_with_stream"] = timed(
            lambda: norm.rms_norm_backward_(dx_in.clone(), h.detach(), w, rstd, res))
        r["norm/copy_of_the_gradient"] = timed(lambda: dx_in.clone())  # in both of the above
        for key, us in r.items():
            result["us"][f"{m}/{key}"] = us
            print(f"{m}/{key}: {us} us", flush=True)
        old = r["gate_up/update_product_bz"] + r["gate_up/liger_swiglu_forward"]
        result["us"][f"{m}/gate_up/forward_saved"] = round(old - r["gate_up/studio_swiglu_forward_with_update"], 1)
        if args.sweep:
            for bm, bn, warps in ((32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (16, 256, 4),
                                  (32, 256, 8), (128, 64, 8), (128, 128, 8)):
                update.BLOCK_M, update.BLOCK_N, update.NUM_WARPS = bm, bn, warps
                update.BACKWARD_BLOCK = (bm, bn)
                fwd = timed(lambda: update.gated(gu, xa, bt, scale, split))
                bwd = timed(lambda: update.gated_backward_(gu, xa, bt, scale, dout, split))
                resid = timed(lambda: update.add_update_and_residual_(ys, xa1, bt1, scale, res))
                key = f"{m}/sweep/{bm}x{bn}_w{warps}"
                result["us"][key] = {"swiglu_forward": fwd, "swiglu_backward": bwd, "residual": resid}
                print(key, result["us"][key], flush=True)
            update.BLOCK_M, update.BLOCK_N, update.NUM_WARPS = 32, 128, 4
            update.BACKWARD_BLOCK = (16, 256)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
