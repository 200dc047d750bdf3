"""The memory a 4-bit load of a mixture of experts takes at its peak (issue 42): the packed model plus
one layer's 16-bit experts when the loader packs them as they arrive (engine/quantized_experts.py),
against packing them after the load, which held the whole model's 16-bit experts at once; for
gpt-oss (``--shape gpt-oss-20b``), the MXFP4 experts kept as they arrive (engine/mxfp4.py), no bf16
expert weight at all, against the old loader's bf16 experts initialized first and replaced after.

Builds a random-weight model with the per-layer shapes of Qwen3-30B-A3B (hidden 2048, 128 experts of
768, 32 query heads over 4 KV heads of 128, vocabulary 151936; saved in bf16 as the Hub ships it, one
tensor per expert and projection) or gpt-oss-20b (Studio's bundled config.json: hidden 2880, 32
experts of 2880, vocabulary 201088; saved as OpenAI ships it, the experts as random MXFP4 blocks and
scales, a shard a layer) on a few layers (the GPU box's 64 GB disk would not hold the models), with
the project's tiny tokenizer, and loads it with Studio's loader (``quantization.bits: 4``, NF4,
double-quantized scales) in a fresh process for each way of loading the experts. Reports
``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` of the load against what the loaded
model holds (the 4-bit model) and one layer's bf16 experts, the most expert bytes in floating point
alive at a packing or MXFP4 keeping (:class:`ExpertBytesProbe`), the host's peak RSS (which counts
the pages of the memory-mapped checkpoint it read), and the same numbers carried to the full model's
layers (48; gpt-oss-20b's 24) by arithmetic (said so in the JSON), with the command, commit, GPU and
versions:

    python bench/moe_load_peak.py --layers 4 --tokenizer .whl/tokenizer --commit $C --out $OUT/moe_load_peak.json
    python bench/moe_load_peak.py --shape gpt-oss-20b --layers 4 --tokenizer .whl/tokenizer --commit $C \
        --out $OUT/gpt_oss_load_peak.json
    python bench/moe_load_peak.py --tiny --cpu --out /tmp/moe_load_peak.json    # the path on the CPU

Four layers take ~6 GB of disk for Qwen3 (~4 GB for gpt-oss), built once in ``/tmp``, reused.
``--cpu`` loads with bitsandbytes' CPU backend, where there is no allocator peak: the probe's count
is the measurement there. ``--tiny``: a four-layer model of eight 48-wide experts (gpt-oss: 96-wide),
seconds to build.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     tie_word_embeddings=False)
"""Qwen3-30B-A3B's config.json, less its 48 layers."""
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256, tie_word_embeddings=False)
"""A Qwen3-MoE whose experts are most of it, as in the real one; 48 wide so that no other weight
has an expert's shape (the probe counts by shape)."""
TINY_GPT_OSS = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, vocab_size=512, sliding_window=8,
                    max_position_embeddings=256)
"""A gpt-oss of eight experts 96 wide (MXFP4 blocks 32 values along each input), no other weight of
an expert's shape."""
NOT_ARCHITECTURE = ("architectures", "transformers_version", "quantization_config", "torch_dtype", "dtype",
                    "eos_token_id", "pad_token_id", "layer_types", "num_hidden_layers", "model_type")
"""Keys of a bundled config.json the build sets itself or leaves out (layer_types: cut with the layers)."""


def bundled(model: str) -> dict[str, Any]:
    """The architecture of Studio's bundled config.json of ``model`` (sample_data/model_configs)."""
    config = json.loads((ROOT / "sample_data" / "model_configs" / model / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in NOT_ARCHITECTURE}


SHAPES = {"qwen3-30b-a3b": ("qwen3_moe", 48), "gpt-oss-20b": ("gpt_oss", 24)}
"""``--shape``: the model type and the real model's layer count."""


def shape_config(name: str, tiny: bool) -> dict[str, Any]:
    """The config fields (all but the layer count) of ``--shape name``, or its tiny version."""
    if name == "gpt-oss-20b":
        return TINY_GPT_OSS if tiny else bundled("openai/gpt-oss-20b")
    return TINY if tiny else QWEN3_30B_A3B
PACKINGS = ("during", "after")
"""``during``: the loader as it is; ``after``: the loader with packing on load turned off, so the
experts load in 16 bits and are packed once the load is done (the loader before issue 42); for
gpt-oss, transformers initializes them in the compute dtype and the shipped MXFP4 replaces them once
the load is done (the loader before the MXFP4 experts were kept on load)."""


class ExpertBytesProbe:
    """The bytes of expert weights alive in floating point on ``device`` (the projection being
    packed, the per-expert checkpoint tensors and their stacks, other layers' experts not packed yet),
    counted over every live tensor of an expert's shape (``[experts, out, in]``, gpt-oss'
    ``[experts, in, out]`` or one expert's ``[out, in]``) each time a projection is about to be packed
    in 4 bits or to keep the MXFP4 its checkpoint ships. :attr:`peak` is the most seen at once."""

    def __init__(self, config: dict[str, Any], device: Any):
        experts, width, hidden = expert_shape(config)
        self.shapes = {(experts, 2 * width, hidden), (experts, hidden, 2 * width), (experts, hidden, width),
                       (experts, width, hidden), (width, hidden), (hidden, width)}
        self.device = device
        self.samples: list[int] = []
        """One count a packing, in order."""

    @property
    def peak(self) -> int:
        """The most expert bytes in floating point alive at once (0 before any packing)."""
        return max(self.samples, default=0)

    def count(self) -> int:
        """Expert bytes in floating point alive on the device now (each storage once; placeholders,
        one value broadcast to the shape, are nothing)."""
        import torch

        storages: dict[int, int] = {}
        for obj in gc.get_objects():
            if (issubclass(type(obj), torch.Tensor) and self._on_device(obj) and obj.is_floating_point()
                    and tuple(obj.shape) in self.shapes):
                storage = obj.untyped_storage()
                if storage.nbytes() > obj.element_size():
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def _on_device(self, tensor: Any) -> bool:
        # "cuda" names whichever card is current, and a tensor always says which ("cuda:0")
        return tensor.device.type == self.device.type and self.device.index in (None, tensor.device.index)

    @contextmanager
    def watching(self) -> Iterator[ExpertBytesProbe]:
        """Count before every packing (engine/quantized_experts.py's one packing step) and every
        keeping of a projection's MXFP4 (engine/mxfp4.py's) while open."""
        from studio.engine import mxfp4, quantized_experts

        packing, keeping = quantized_experts._quantize, mxfp4._keep

        def counted(step: Any) -> Any:
            def step_counted(*args: Any, **kwargs: Any) -> Any:
                self.samples.append(self.count())
                return step(*args, **kwargs)
            return step_counted

        quantized_experts._quantize, mxfp4._keep = counted(packing), counted(keeping)
        try:
            yield self
        finally:
            quantized_experts._quantize, mxfp4._keep = packing, keeping


def expert_shape(config: dict[str, Any]) -> tuple[int, int, int]:
    """(experts, one expert's intermediate width, hidden size) of a Qwen3-MoE, Mixtral or OLMoE
    config.json (``num_experts`` or ``num_local_experts``; ``moe_intermediate_size`` where the family
    has one, else ``intermediate_size``)."""
    experts = config.get("num_experts") or config["num_local_experts"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    return int(experts), int(width), int(config["hidden_size"])


def expert_bytes(config: dict[str, Any], layers: int, element_size: int) -> int:
    """Bytes of ``layers`` sparse layers' expert weights (gate, up and down) at ``element_size``."""
    experts, width, hidden = expert_shape(config)
    return layers * experts * 3 * width * hidden * element_size


def build(folder: Path, shape_name: str, shape: dict[str, Any], layers: int, device: str,
          tokenizer: Path | None = None) -> Path:
    """A random-weight model of ``shape`` with ``layers`` layers saved to ``folder`` with the
    tokenizer of the folder ``tokenizer`` (default: the tiny model's); reused when there. A
    Qwen3-MoE is saved in bf16 as the Hub ships it (a tensor per expert); a gpt-oss as OpenAI ships
    theirs (:func:`save_gpt_oss`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from studio.engine.tiny import build_tiny_model

    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    model_type = SHAPES[shape_name][0]
    config = AutoConfig.for_model(model_type, num_hidden_layers=layers, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **shape)
    if model_type == "gpt_oss":
        save_gpt_oss(folder, config)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder, max_shard_size="2GB")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()  # the loads run in other processes; leave them the card
    AutoTokenizer.from_pretrained(tokenizer or build_tiny_model()).save_pretrained(folder)
    return folder


def save_gpt_oss(folder: Path, config: Any) -> None:
    """A random gpt-oss of ``config`` saved as OpenAI ships theirs: bf16 weights, the experts'
    projections as random MXFP4 blocks and scales (``<name>_blocks [experts, out, in / 32, 16]``,
    ``<name>_scales [experts, out, in / 32]``), a shard a layer with the index, ``quant_method:
    mxfp4`` in config.json. Built tensor by tensor from the model's shapes on the meta device: the
    build never holds the experts in bf16."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, Any]] = {}
    for name, meta in model.state_dict().items():
        parts = name.split(".")
        shard = f"model-layer-{int(parts[2]):03d}.safetensors" if parts[1:2] == ["layers"] else "model-rest.safetensors"
        tensors = shards.setdefault(shard, {})
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            experts, fan_in, fan_out = meta.shape  # [experts, in, out] in the model
            # every code; scales near 2^-7, a trained model's order of magnitude for these widths
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16),
                                                      dtype=torch.uint8, generator=g)
            tensors[f"{name}_scales"] = torch.randint(119, 124, (experts, fan_out, fan_in // 32),
                                                      dtype=torch.uint8, generator=g)
        else:
            tensors[name] = (torch.randn(meta.shape, generator=g) * 0.02).to(meta.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shipped = {**config.to_dict(), "dtype": "bfloat16",
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (folder / "config.json").write_text(json.dumps(shipped))


def measure(folder: Path, device_name: str, packing: str) -> dict[str, Any]:
    """Load ``folder`` in 4 bits with Studio's loader on ``device_name`` (``packing``: one of
    :data:`PACKINGS`) and report its memory. Meant for a fresh process: the allocator's and the
    host's peaks are the process's."""
    import torch

    from studio.core.config import RunConfig
    from studio.engine import quantized_experts
    from studio.engine.memory import parameter_bytes
    from studio.engine.model import load_base

    device = torch.device(device_name)
    config = RunConfig()
    config.model.base_model = str(folder)
    config.quantization.bits, config.quantization.on_cpu = 4, "keep"
    model_config = json.loads((folder / "config.json").read_text())
    probe = ExpertBytesProbe(model_config, device)
    if packing == "after":
        quantized_experts.experts_packed_on_load = lambda: nullcontext(quantized_experts.ExpertsLoad())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    host_before = _host_peak()
    start = time.perf_counter()
    with probe.watching():
        base = load_base(config, device=device)
    seconds = time.perf_counter() - start
    model = base.model
    held = parameter_bytes(model)
    layer = parameter_bytes(model.model.layers[0])
    result: dict[str, Any] = {
        "packing": packing, "quantization": base.quantization, "warnings": base.warnings,
        "load_seconds": round(seconds, 2),
        "weights_bytes": held["weights"] + held["experts"],
        "packed_experts_bytes": held["experts"],
        "layer_weights_bytes": layer["weights"] + layer["experts"],
        "probe_peak_expert_bytes": probe.peak,
        "probe_samples": len(probe.samples),
        "host_peak_rss_bytes": _host_peak(),
        "host_peak_rss_before_load_bytes": host_before,
    }
    if cuda:
        torch.cuda.synchronize(device)
        result.update(allocated_after_load_bytes=torch.cuda.memory_allocated(device),
                      reserved_after_load_bytes=torch.cuda.memory_reserved(device),
                      max_allocated_bytes=torch.cuda.max_memory_allocated(device),
                      max_reserved_bytes=torch.cuda.max_memory_reserved(device))
    return result


def _host_peak() -> int:
    """This process's peak resident bytes since its exec (Linux's VmHWM; ``ru_maxrss`` elsewhere,
    which on Linux also counts the parent's memory at the fork)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(folder: Path, device: str, packing: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "bench.moe_load_peak", "--measure", str(folder),
                           "--device", device, "--packing", packing], cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"packing": packing, "error": (done.stderr or done.stdout)[-3000:]}
    return json.loads(lines[-1])


def _versions() -> dict[str, str]:
    import bitsandbytes
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "transformers": transformers.__version__, "bitsandbytes": bitsandbytes.__version__}


def _gpu(device: str) -> dict[str, Any]:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return {"name": "cpu"}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_bytes": props.total_memory}


def _commit(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else "unknown (pass --commit)"


def _full_model(shape_name: str, tiny: bool, layers: int, run: dict[str, Any],
                one_layer_bf16: int) -> dict[str, Any] | None:
    """The real model's layers by arithmetic from a run on ``layers``: the non-layer weights as
    measured, every layer as layer 0's, and the load's peak over the loaded weights as measured."""
    if tiny or "max_reserved_bytes" not in run:
        return None
    full = SHAPES[shape_name][1]
    per_layer = run["layer_weights_bytes"]
    weights = run["weights_bytes"] - layers * per_layer + full * per_layer
    over = run["max_reserved_bytes"] - run["allocated_after_load_bytes"]
    return {"how": f"arithmetic, not a measurement: the {layers}-layer run's non-layer weights, {full} "
                   "times its layer 0, plus its peak reserved above the loaded weights",
            "weights_bytes": weights, "peak_reserved_bytes": weights + over,
            "experts_bytes_in_16_bits": full * one_layer_bf16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the built model (all sparse)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                        help="whose per-layer shapes (gpt-oss-20b: its experts as MXFP4 blocks, as shipped)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes of the same family instead of the real ones")
    parser.add_argument("--cpu", action="store_true", help="load on the CPU (bitsandbytes' CPU backend)")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the built model lives (reused)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with the tokenizer to save beside the model (default: the tiny model's)")
    parser.add_argument("--commit", default=None, help="the commit this tree is (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--packing", choices=PACKINGS, default="during", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:  # the child: one load, one JSON line
        print(json.dumps(measure(args.measure, args.device, args.packing)), flush=True)
        return 0

    import torch

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    shape = shape_config(args.shape, args.tiny)
    label = f"{args.shape}-tiny" if args.tiny else args.shape
    folder = args.model_dir or Path(tempfile.gettempdir()) / f"studio-moe-load-{label}-{args.layers}l"
    build(folder, args.shape, shape, args.layers, device, args.tokenizer)
    runs = {packing: _child(folder, device, packing) for packing in PACKINGS}
    # The loader's dtype: bf16 on a GPU, fp32 on the CPU (engine/model.py's compute_dtype)
    element = 2 if device == "cuda" else 4
    one_layer = expert_bytes(shape, 1, element)
    for run in runs.values():
        if "max_reserved_bytes" in run:
            above = run["max_reserved_bytes"] - run["allocated_after_load_bytes"]
            run["reserved_above_loaded_weights_in_layers"] = round(above / one_layer, 2)
    report = {
        "command": "python bench/moe_load_peak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": _commit(args.commit), "gpu": _gpu(device), "versions": _versions(),
        "model": {"shape": args.shape, "tiny": args.tiny, "layers": args.layers, "config": shape,
                  "folder": str(folder)},
        "load_dtype": "bfloat16" if element == 2 else "float32",
        "one_layer_experts_bytes": one_layer,
        "model_experts_bytes": expert_bytes(shape, args.layers, element),
        "runs": runs,
        "full_model_estimate": _full_model(args.shape, args.tiny, args.layers, runs["during"], one_layer),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if all("error" not in run for run in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
