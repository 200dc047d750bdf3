"""How much this process holds on the card beyond torch's pool (CUDA context, cuBLAS handles), as
studio/engine/memory.py measures it, against the estimator's CUDA_CONTEXT_BYTES.

    PYTHONPATH=. python bench/cuda_context.py --out bench/results/current/cuda_context_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from studio.core.memory import CUDA_CONTEXT_BYTES  # noqa: E402
from studio.engine.memory import context_bytes, process_gpu_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    # the context alone; then with cuBLAS initialised by a bf16 matmul; then with 2 GiB in the pool
    x = torch.ones(1, device=device)
    rows.append(("context", process_gpu_bytes(), torch.cuda.memory_reserved(device), context_bytes(device)))
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    rows.append(("after a bf16 matmul", process_gpu_bytes(), torch.cuda.memory_reserved(device),
                 context_bytes(device)))
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    rows.append(("with 2 GiB allocated", process_gpu_bytes(), torch.cuda.memory_reserved(device),
                 context_bytes(device)))
    del x, a, big
    result = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "pid": os.getpid(),
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "modelled_context": CUDA_CONTEXT_BYTES,
              "rows": [{"moment": m, "process_bytes": p, "reserved": r, "context": c} for m, p, r, c in rows]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
