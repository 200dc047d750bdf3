"""Build a model with random weights in a known architecture, for speed and memory benchmarks.

The GPU machine cannot download weights, and random weights cost the same to train as real ones.
Builds the architecture on the GPU in bf16 (seconds), saves it with ``save_pretrained`` and copies
in a tokenizer (the project's tiny byte-level BPE: its ids are all below the model's vocabulary),
so the folder loads like any checkpoint, 4-bit included.

The mixtures of experts (bench/moe_shapes.py: Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B, OLMoE-1B-7B)
are mostly too big for the GPU box's 64 GB disk in bf16 (Qwen3-30B-A3B 61 GB, Mixtral 93 GB;
gpt-oss-20b 42 GB). ``--layers N`` builds the first N layers with every layer's real shape and the
real embeddings and head; ``--layers fit`` as many as the disk at ``--out`` holds. The build is
refused, before anything is built, when the folder would not fit there. Every build writes
``random_build.json`` beside config.json: the layers built against the model's, and what a
measurement on it means (:func:`read_build`); the benchmarks copy it into their results.

Weights generated in memory, never saved, would skip the disk; Studio cannot take them: its loader
(engine/model.py) and its worker (a process of its own, started by ``studio train``) read a model
folder or a Hub id, as a user's run does. A RAM-backed folder is the way round the disk where the
box has one big enough: ``--out /dev/shm/NAME`` (the same check of the room there; the 128 GB of
host memory then hold the folder and the processes that load it).

    python bench/make_random_model.py --arch llama2-7b --out /tmp/llama2-7b-random
    python bench/make_random_model.py --arch llama3-8b --out /tmp/llama3-8b-random
    python bench/make_random_model.py --arch qwen3-30b-a3b --layers 12 --out /tmp/models/qwen3-30b-a3b-l12
    python bench/make_random_model.py --arch gpt-oss-20b --layers fit --out /dev/shm/gpt-oss-20b
    python bench/make_random_model.py --arch qwen3-30b-a3b --size-only   # bytes of the full build and each layer
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.moe_shapes import HUB_IDS, MOE_MODELS, layer_subset  # noqa: E402

ARCHS = {
    # Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads (no GQA), vocab 32000, untied head.
    "llama2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    # Llama-3-8B: 32 layers, hidden 4096, MLP 14336, 32 heads over 8 KV heads, vocab 128256, untied head.
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    # SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 heads over 3 KV heads, vocab 49152, tied head.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    **MOE_MODELS,
}
"""Each architecture's config.json values (``model_type`` included)."""

BUILD_FILE = "random_build.json"
"""What a build was, beside its config.json (:func:`read_build`)."""
DISK_MARGIN = 2 * 10**9
"""Bytes left free on the disk after a build (the runs write their own files beside it)."""


def hf_config(shape: dict):
    """The transformers config of ``shape`` (the tiny tokenizer's token ids)."""
    from transformers import AutoConfig

    fields = dict(shape)
    return AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def sizes(shape: dict) -> dict:
    """The bf16 bytes of ``shape`` built whole, and how they split: one layer's bytes (every layer
    the same), the rest (embeddings, head, final norm). Made on torch's meta device: nothing is
    allocated, a 30B model is sized in a second."""
    import torch
    from transformers import AutoModelForCausalLM

    def size(layers: int) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(layer_subset(shape, layers)), dtype=torch.bfloat16)
        return sum(p.numel() for p in model.parameters()) * 2

    one, two = size(1), size(2)
    layers = int(shape["num_hidden_layers"])
    return {"layers": layers, "layer_bytes": two - one, "other_bytes": 2 * one - two,
            "total_bytes": 2 * one - two + layers * (two - one)}


def free_bytes(folder: Path) -> int:
    """Free bytes of the filesystem ``folder`` is (or will be) on."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def layers_that_fit(sized: dict, free: int) -> int:
    """The most layers whose bf16 folder fits in ``free`` bytes less :data:`DISK_MARGIN` (0: none)."""
    room = free - DISK_MARGIN - sized["other_bytes"]
    return max(0, min(sized["layers"], room // sized["layer_bytes"]))


def room_problem(name: str, sized: dict, layers: int, out: Path, free: int) -> str:
    """Why ``layers`` layers of ``name`` do not fit at ``out`` ('' when they do), with what would."""
    need = sized["other_bytes"] + layers * sized["layer_bytes"]
    if need + DISK_MARGIN <= free:
        return ""
    most = layers_that_fit(sized, free)
    what = f"{layers} of its {sized['layers']} layers" if layers < sized["layers"] else "the whole model"
    advice = f"--layers {most} or fewer fit there" if most else "not even one layer fits there"
    return (f"{name}: {what} in bf16 needs {need / 1e9:.1f} GB at {out} and {free / 1e9:.1f} GB is free there "
            f"(keeping {DISK_MARGIN / 1e9:.0f} GB): {advice}, or point --out at a bigger filesystem "
            f"(/dev/shm is RAM-backed where the box has one)")


def meaning(name: str, layers: int, real: int) -> str:
    """What a measurement on this build stands for, in words."""
    if layers >= real:
        return f"the whole {name} ({real} layers) with random weights: a measurement on it is the real model's"
    return (f"the first {layers} of {name}'s {real} layers, each in its real shape, with the real embeddings and "
            f"head: time and memory per layer are the real model's; totals (tokens/s, peak memory, whether it fits a "
            f"card) are a {layers}-layer model's, not the whole model's")


def build_model(name: str, shape: dict, out: Path, *, layers: int | None = None, seed: int = 0,
                tokenizer: Path | None = None, hub_id: str | None = None) -> Path:
    """Build ``shape`` (the first ``layers`` layers; None: all) with random weights (normal, std
    0.02) and save it with a tokenizer (copied from the folder ``tokenizer``, else the project's tiny
    model's) and :data:`BUILD_FILE` to ``out``. Reuses a complete folder of the same build; refuses
    (SystemExit, before building) when the folder would not fit the disk at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    real = int(shape["num_hidden_layers"])
    layers = real if layers is None else layers
    subset = layer_subset(shape, layers)
    done = read_build(out)
    if done is None and (out / "config.json").exists() and (out / "tokenizer.json").exists():
        print(f"{out} exists (built before builds were recorded); reusing it", flush=True)
        return out
    if done is not None and (out / "tokenizer.json").exists():
        if done["layers_built"] == layers and done["arch"] == name:
            print(f"{out} exists ({done['layers_built']} of {done['layers_real']} layers); reusing it", flush=True)
            return out
        raise SystemExit(f"{out} holds another build ({done['arch']}, {done['layers_built']} layers): "
                         "remove it or choose another --out")
    sized = sizes(shape)
    free = free_bytes(out)
    problem = room_problem(name, sized, layers, out, free)
    if problem:
        raise SystemExit(problem)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(subset), dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    built_s = time.perf_counter() - t0
    print(f"built {name} ({layers} of {real} layers, {params / 1e9:.2f} B params) on {device} in {built_s:.1f} s",
          flush=True)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="4GB")
    saved_s = time.perf_counter() - t0
    print(f"saved to {out} in {saved_s:.1f} s", flush=True)
    del model
    record = {"arch": name, "hub_id": hub_id, "layers_built": layers, "layers_real": real,
              "full_model": layers >= real, "meaning": meaning(name, layers, real), "params": params,
              "bytes_bf16": params * 2, "full_model_bytes_bf16": sized["total_bytes"],
              "layer_bytes_bf16": sized["layer_bytes"], "free_bytes_before": free, "seed": seed,
              "built_on": device, "build_s": round(built_s, 1), "save_s": round(saved_s, 1)}
    (out / BUILD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    try:
        _copy_tokenizer(out, tokenizer)
    except Exception as exc:  # noqa: BLE001 - the benchmark's token-id workloads need no tokenizer
        print(f"no tokenizer copied ({exc}); the folder loads as a model only", flush=True)
    return out


def build(arch: str, out: Path, seed: int = 0, tokenizer: Path | None = None, layers: int | str | None = None) -> Path:
    """Build ``arch`` (:data:`ARCHS`) to ``out``; ``layers``: a count, ``fit`` (as many as the disk at
    ``out`` holds) or None (all)."""
    shape = ARCHS[arch]
    if layers == "fit":
        layers = layers_that_fit(sizes(shape), free_bytes(out)) or 1
    return build_model(arch, shape, out, layers=layers, seed=seed, tokenizer=tokenizer, hub_id=HUB_IDS.get(arch))


def read_build(folder: Path) -> dict | None:
    """What :func:`build_model` recorded of the folder (None: not one of its builds, e.g. a real
    checkpoint or a dense family built by bench/families.py)."""
    path = Path(folder) / BUILD_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _copy_tokenizer(out: Path, source: Path | None) -> None:
    if source is None:
        from studio.engine.tiny import build_tiny_model

        source = build_tiny_model()
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)


def _layers(value: str) -> int | str:
    if value == "fit":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {value}: a number of layers, or fit") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama2-7b")
    parser.add_argument("--out", type=Path, help="the folder to write (required unless --size-only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, default=None, help="folder with tokenizer.json to copy")
    parser.add_argument("--layers", type=_layers, default=None,
                        help="build the first N layers (each in its real shape), or fit: as many as the disk at "
                             "--out holds; default all")
    parser.add_argument("--size-only", action="store_true",
                        help="print the bf16 bytes of the whole model and of one layer (and what fits at --out); "
                             "build nothing")
    args = parser.parse_args(argv)
    if args.size_only:
        sized = sizes(ARCHS[args.arch])
        if args.out is not None:
            free = free_bytes(args.out)
            sized.update(free_bytes=free, layers_that_fit=layers_that_fit(sized, free))
        print(json.dumps({"arch": args.arch, **sized}))
        return 0
    if args.out is None:
        parser.error("--out is required")
    try:
        build(args.arch, args.out, args.seed, args.tokenizer, args.layers)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
