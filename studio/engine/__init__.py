"""The only layer that imports torch, transformers, peft and bitsandbytes.

The CUDA caching allocator reads PYTORCH_CUDA_ALLOC_CONF when it first allocates, so it is set here,
before any engine module touches the GPU. Expandable segments let the allocator grow one mapping
instead of caching many fixed-size segments: reserved memory stays close to allocated memory, which
matters on small cards and keeps CUDA-graph pools from stranding memory. A user's own setting wins.
"""

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
