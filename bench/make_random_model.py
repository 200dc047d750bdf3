"""Build a model with random weights in a known architecture, for speed and memory benchmarks.

The GPU machine cannot download weights, and random weights cost the same to train as real ones.
Builds the architecture on the GPU in bf16 (seconds), saves it with ``save_pretrained`` and copies
in a tokenizer (the project's tiny byte-level BPE: its ids are all below the model's vocabulary),
so the folder loads like any checkpoint, 4-bit included.

    python bench/make_random_model.py --arch llama2-7b --out /tmp/llama2-7b-random
    python bench/make_random_model.py --arch smollm2-135m --out /tmp/smollm2-135m-random
    python bench/make_random_model.py --arch llama3-8b --out /tmp/llama3-8b-random
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ARCHS = {
    # Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads (no GQA), vocab 32000, untied head.
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    # Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 32 heads over 8 KV heads, vocab 128256, untied head.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    # SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 heads over 3 KV heads, vocab 49152, tied head.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
}


def build(arch: str, out: Path, seed: int = 0, tokenizer: Path | None = None) -> Path:
    """Build ``arch`` with random weights (normal, std 0.02) and save it with a tokenizer to ``out``
    (copied from the folder ``tokenizer``, else the project's tiny model's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        print(f"{out} exists; reusing it", flush=True)
        return out
    config = LlamaConfig(**ARCHS[arch], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    print(f"built {arch} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params) on {device} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="2GB")
    print(f"saved to {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    del model
    try:
        _copy_tokenizer(out, tokenizer)
    except Exception as exc:  # noqa: BLE001 - the benchmark's token-id workloads need no tokenizer
        print(f"no tokenizer copied ({exc}); the folder loads as a model only", flush=True)
    return out


def _copy_tokenizer(out: Path, source: Path | None) -> None:
    if source is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from studio.engine.tiny import build_tiny_model

        source = build_tiny_model()
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama2-7b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=None, help="folder with tokenizer.json to copy")
    args = parser.parse_args()
    build(args.arch, args.out, args.seed, args.tokenizer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
