"""Load the base model (4-bit NF4/FP4, 8-bit, bf16 or fp32), attach LoRA, save the adapter; or
prepare every weight to train (full fine-tuning, ``lora: null``).

QLoRA in one picture: the base weights are frozen and stored small (4-bit NF4 through bitsandbytes),
matmuls run in the compute dtype (bf16 on a GPU), and only the low-rank adapter matrices train, in
fp32. Without a CUDA GPU a 4-bit or 8-bit config loads its base in fp32 with a notice (the CPU plan:
quantization saves GPU memory, on a CPU it only costs time); ``quantization.on_cpu: keep`` tries
bitsandbytes' CPU backend instead, falling back to fp32 with a warning when that backend is missing.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from studio.core.config import ConfigError, RunConfig
from studio.core.model.ref import local_problem
from studio.core.runs.storage import replace_folder, sync_tree

Progress = Callable[[str, float], None]
"""progress(stage, fraction 0..1): what the loader is doing."""


class ModelLoadError(RuntimeError):
    """The model cannot be loaded (not found, offline, unreadable); the message says what to do."""


@dataclass
class BaseModel:
    """A loaded base model and what it took to load it."""

    model: Any
    tokenizer: Any
    device: torch.device
    compute_dtype: torch.dtype
    quantization: str
    """How the weights are stored: ``nf4``, ``fp4``, ``int8`` or the dtype name."""

    path: str
    """The local folder (or hub id) the weights came from."""

    warnings: list[str] = field(default_factory=list)
    """Things the user should know (a fallback taken), for WarningRaised events."""

    seconds: float = 0.0


def pick_device() -> torch.device:
    """The GPU when there is one (``STUDIO_DEVICE=cpu`` forces the CPU)."""
    wanted = os.environ.get("STUDIO_DEVICE")
    if wanted:
        return torch.device(wanted)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: ``auto`` is bf16 on a GPU that has it, fp32 elsewhere."""
    name = config.quantization.compute_dtype
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16 if device.type == "cuda" else torch.float32
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32  # fp16 matmuls on CPU are slow and lose precision for nothing
    return dtype


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, with a pad token (the EOS token when the model has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Padding is masked out of attention and loss, so any id works; EOS is always there.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(config: RunConfig, progress: Progress | None = None,
              device: torch.device | None = None) -> BaseModel:
    """Load the frozen base model and its tokenizer as the config asks (quantized or not)."""
    from studio.engine.pull import resolve_model

    say = progress or (lambda _stage, _fraction: None)
    start = time.time()
    device = device or pick_device()
    dtype = compute_dtype(config, device)
    say("finding the model", 0.0)
    problem = local_problem(config.model.base_model)
    if problem:
        raise ModelLoadError(problem)
    path = resolve_model(config.model.base_model, progress=lambda msg: say(msg, 0.05))
    say("loading the tokenizer", 0.1)
    try:
        tokenizer = load_tokenizer(path, config.model.revision, config.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_not_found(config.model.base_model, exc)) from None
    warnings: list[str] = []
    bits = config.quantization.bits
    if bits is not None and device.type != "cuda" and config.quantization.on_cpu != "keep":
        # k-bit weights save GPU memory; on a CPU bitsandbytes' kernels only cost time (10x or more).
        warnings.append(f"no CUDA GPU: loading the base in {str(dtype).removeprefix('torch.')} instead of "
                        f"{bits}-bit (quantization only saves GPU memory; on a CPU it is slower); set "
                        "quantization.on_cpu: keep to quantize anyway")
        bits = None
    say("loading the weights", 0.2)
    model, quantization = None, ""
    if bits is not None:
        try:
            model, quantization = _load_quantized(config, path, device, dtype, warnings)
        except Exception as exc:  # bitsandbytes raises many kinds; any of them means "no k-bit here"
            if device.type == "cuda":
                raise ModelLoadError(f"{config.model.base_model}: {bits}-bit loading failed ({exc}); check "
                                     "that bitsandbytes matches your CUDA, or set quantization.bits: null") from None
            warnings.append(f"{bits}-bit quantization is not available on this CPU ({_first_line(exc)}); "
                            "loading the weights in float32 instead (more memory, same training)")
    if model is None:
        model = _load_plain(config, path, device, dtype)
        quantization = str(dtype).removeprefix("torch.")
    model.config.use_cache = False  # the KV cache only costs memory while training
    if device.type == "cuda":
        give_back_load_memory()
    say("weights loaded", 0.8)
    return BaseModel(model, tokenizer, device, dtype, quantization, path, warnings, time.time() - start)


def give_back_load_memory() -> None:
    """Hand the load's freed memory back to the driver: a 4-bit load holds a layer's experts in 16
    bits while it packs them, and the checkpoint's shards pass through the card. The caching allocator
    keeps those pages mapped, free but reserved, so the run would start with them reserved: other
    processes could not use them, and a training step's peak reserved would read the load's."""
    from studio.engine.oom import free

    free(torch.device("cuda"))


def _load_plain(config: RunConfig, path: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from studio.engine.mxfp4 import shipped_config

    try:
        # MXFP4 experts (gpt-oss) in the compute dtype: transformers' dequantization, never its MXFP4
        # inference kernels (they train nothing, and come from the Hub)
        mxfp4 = shipped_config(path, config.model.revision, config.model.trust_remote_code) is not None
        model = AutoModelForCausalLM.from_pretrained(
            path, revision=config.model.revision, trust_remote_code=config.model.trust_remote_code,
            dtype=dtype, **({"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_not_found(config.model.base_model, exc)) from None
    return model.to(device)


def _load_quantized(config: RunConfig, path: str, device: torch.device, dtype: torch.dtype,
                    warnings: list[str]) -> tuple[Any, str]:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from studio.engine.mxfp4 import load_experts, shipped_config
    from studio.engine.quantized_experts import experts_packed_on_load, quantize_experts

    q = config.quantization
    if q.bits == 4:
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                                 bnb_4bit_use_double_quant=q.double_quant, bnb_4bit_compute_dtype=dtype,
                                 bnb_4bit_quant_storage=torch.uint8)
        name = q.quant_type
    elif q.bits == 8:
        bnb = BitsAndBytesConfig(load_in_8bit=True)
        name = "int8"
    else:
        raise ConfigError(f"quantization.bits is {q.bits}; choose 4, 8 or null")
    target = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    # gpt-oss ships its experts in MXFP4: kept so (engine/mxfp4.py), the rest quantized by bitsandbytes
    shipped = shipped_config(path, config.model.revision, config.model.trust_remote_code) if q.bits == 4 else None
    # bitsandbytes quantizes linear modules only: a mixture of experts' 3-D expert weights, most of
    # its memory, are packed as they load (engine/quantized_experts.py), or kept in the MXFP4 the
    # checkpoint ships, so the device never holds them all in 16 bits.
    with experts_packed_on_load() as experts:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, revision=config.model.revision, trust_remote_code=config.model.trust_remote_code,
                quantization_config=bnb, dtype=dtype, device_map=target,
                **({"config": shipped} if shipped is not None else {}))
        finally:
            # transformers logs a failed conversion and initializes the weight at random, then goes on
            # or fails pointing at its log: the error itself is the one to show
            if experts.failures:
                where, why = next(iter(experts.failures.items()))
                raise RuntimeError(f"packing the expert weights in 4 bits failed ({where}: {why})")
    if shipped is not None:
        late = load_experts(model, path)
        if late:
            warnings.append(f"{late} experts modules took their MXFP4 weights after the load, not during it "
                            f"(this transformers' loader did not hand them over): their weights in "
                            f"{str(dtype).removeprefix('torch.')} were all on the {device.type} at once, which a card "
                            "that fits the model may not hold")
        return model, name
    if q.bits == 4:
        late = quantize_experts(model, q.quant_type, q.double_quant)
        if late:
            warnings.append(f"{late} experts modules were packed in 4 bits after the load, not during it "
                            f"(this transformers' loader did not hand them over): their 16-bit weights were "
                            f"all on the {device.type} at once, which a card that fits the packed model may not hold")
    return model, name


def fast_path_ahead(model: Any, config: RunConfig) -> bool:
    """Whether the trainer will take the fast path for this freshly loaded base and config: the
    same decision (core/plan.py's choose_path) that engine/fast/build.enable takes on the model
    with its adapter, made from the config before the adapter is attached."""
    from studio.core.decoder import describe_decoder
    from studio.core.plan import PathFacts, choose_path, model_blocker, sparse_mlp

    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if getattr(model, "is_loaded_in_4bit", False):
        weights = str(getattr(quant, "bnb_4bit_quant_type", "nf4"))
    elif getattr(model, "is_loaded_in_8bit", False):
        weights = "int8"
    else:
        weights = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(model.dtype, "?")
    device = next(model.parameters()).device
    config_dict = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    facts = PathFacts.from_config(config, cuda=device.type == "cuda", weights=weights,
                                  model_blocker=model_blocker(config_dict),
                                  moe=sparse_mlp(describe_decoder(config_dict)))
    return choose_path(facts).path == "fast"


def attach_lora(base: BaseModel, config: RunConfig) -> Any:
    """Freeze the base, prepare it for k-bit training, and wrap it with a fresh LoRA adapter (peft).

    The adapter's weights are initialised from torch's RNG: seed before calling for a repeatable run.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = base.model
    checkpointing = config.trainer.checkpointing()
    # Non-reentrant checkpointing works with frozen inputs and does not need the input-grad hack.
    ckpt_kwargs = {"use_reentrant": False}
    with warnings.catch_warnings():
        # peft still calls transformers' deprecated gradient_checkpointing_* names; not ours to fix.
        warnings.simplefilter("ignore", FutureWarning)
        kbit = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        # GRPO keeps the base's embeddings, head and residual stream in the compute dtype too: its
        # sampling KV cache and the scored pass's logits would otherwise be fp32 (core/memory/plan.py's
        # kbit_upcast).
        if kbit and not fast_path_ahead(model, config) and config.trainer.method != "grpo":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                                    gradient_checkpointing_kwargs=ckpt_kwargs)
        else:
            # The fast path computes in the compute dtype from embedding to loss and would cast
            # back what prepare_model_for_kbit_training casts up to fp32; skipping that cast keeps
            # its fp32 copies of the embeddings and head from setting the run's peak (Llama-3-8B,
            # 128k vocabulary: 10.4 GiB before the first step, 7.1 in it; docs/memory.md).
            for param in model.parameters():
                param.requires_grad_(False)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    lora = config.lora
    targets: Any = lora.target_modules
    if isinstance(targets, list) and targets == ["all-linear"]:
        targets = "all-linear"  # peft only recognises the shorthand as a plain string
    if targets == "all-linear" and has_experts(model):
        targets = linear_module_names(model)
    experts = expert_targets(model, config)
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets, bias="none", task_type="CAUSAL_LM",
                             use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                             target_parameters=experts or None)
    try:
        with warnings.catch_warnings(), names_as_written():
            warnings.simplefilter("ignore", FutureWarning)  # peft: is_gradient_checkpointing
            model = get_peft_model(model, peft_config)
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in base.model.named_modules()
                        if isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__})
        raise ConfigError(f"lora.target_modules {lora.target_modules!r} matches no layer of "
                          f"{config.model.base_model} ({_first_line(exc)}); linear layers there: "
                          f"{', '.join(names)} (or use all-linear)") from None
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # adapters train in fp32; autocast handles the matmuls
    base.model = model
    return model


def expert_targets(model: Any, config: RunConfig) -> list[str]:
    """PEFT's ``target_parameters`` for ``lora.target_experts``: every sparse layer's expert weights
    (``mlp.experts.gate_up_proj`` and ``down_proj``); empty when the key is off. ConfigError naming
    the key when it is on and the model has no experts."""
    from studio.core.decoder.spec import EXPERT_PARAMETERS, EXPERTS, MLP

    if config.lora is None or not config.lora.target_experts:
        return []
    suffixes = [f"{MLP}.{EXPERTS}.{name}" for name in EXPERT_PARAMETERS]
    found = {name for name, _ in model.named_parameters()}
    missing = [s for s in suffixes if not any(n.endswith(s) for n in found)]
    if missing:
        raise ConfigError(f"lora.target_experts is true but {config.model.base_model} has no mixture-of-experts "
                          f"weights ({', '.join(missing)} not found); set lora.target_experts: false")
    return suffixes


def prepare_full_finetune(base: BaseModel, config: RunConfig) -> Any:
    """Every weight of the (unquantized) base trains: no adapter, parameters in the compute dtype as
    loaded (bf16 on a GPU, fp32 on a CPU), gradient checkpointing as the config asks. AdamW then keeps
    its m and v in that dtype too (torch's AdamW allocates them like the parameter): no fp32 master
    copy, the memory core/memory/ predicts for ``lora: null``."""
    model = base.model
    if base.quantization in ("nf4", "fp4", "int8"):  # config validation refuses it; a guard, not a path
        raise ConfigError(f"lora is null (full fine-tuning) but the base loaded as {base.quantization}; "
                          "set quantization.bits: null")
    for param in model.parameters():
        param.requires_grad_(True)
    if config.trainer.checkpointing():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_adapter(base: BaseModel, adapter_dir: str | Path) -> Any:
    """Wrap the loaded base with a saved adapter (``runs/<id>/adapter`` or a checkpoint's) for inference.
    A full fine-tune's saved model (``runs/<id>/model``) replaces the base's weights instead."""
    from peft import PeftModel

    from studio.core.runs import is_full_model

    if is_full_model(Path(adapter_dir)):
        from studio.engine.checkpoint import load_model_weights

        load_model_weights(base.model, Path(adapter_dir))
        return base.model
    with warnings.catch_warnings(), names_as_written():
        warnings.simplefilter("ignore", FutureWarning)  # peft: is_gradient_checkpointing
        model = PeftModel.from_pretrained(base.model, str(adapter_dir))
    base.model = model
    return model


def has_experts(model: Any) -> bool:
    """Whether ``model`` has a mixture of experts' 3-D expert weights (``mlp.experts.gate_up_proj``)."""
    from studio.core.decoder.spec import EXPERT_PARAMETERS, EXPERTS

    return any(name.endswith(f".{EXPERTS}.{EXPERT_PARAMETERS[0]}") for name, _ in model.named_parameters())


def linear_module_names(model: Any) -> list[str]:
    """``all-linear`` on a mixture of experts, as names PEFT takes literally: the leaf names of its
    linear modules (4-bit and 8-bit ones included), the output head and the routers left out.

    The router of a sparse block (the module beside ``experts``) stays frozen, as it is frozen on
    both paths and in the estimate; PEFT's own reading of ``all-linear`` on such a model adds the
    experts and the router's weight (:func:`names_as_written`)."""
    from studio.core.decoder.spec import EXPERTS

    routers = {f"{name}.{child}" if name else child
               for name, module in model.named_modules() if hasattr(module, EXPERTS)
               for child, sub in module.named_children() if child != EXPERTS}
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and name not in routers
             and name.rsplit(".", 1)[-1] != "lm_head"}
    return sorted(names)


@contextmanager
def names_as_written() -> Iterator[None]:
    """While open, PEFT takes an adapter's ``target_modules`` as written.

    PEFT 0.21 rewrites the targets of a mixture of experts that transformers 5 restructured, to load
    adapters trained on transformers 4: ``gate_proj`` / ``up_proj`` / ``down_proj`` (or Mixtral's
    ``w1``-``w3``) become the fused experts' parameters at twice the rank, ``gate`` the router's
    weight, and ``all-linear`` all of them. Studio's adapters are written for transformers 5's
    modules (the experts through ``lora.target_experts``), so the rewrite would put adapters on the
    experts and the router that the config never asked for, on the plain path, at a memory the
    estimate never saw. Where PEFT has no such rewrite, nothing changes."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        yield
        return
    original = getattr(conversion, "convert_peft_config_for_transformers", None)
    if original is None:
        yield
        return
    conversion.convert_peft_config_for_transformers = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def save_adapter(model: Any, directory: str | Path, config: RunConfig | None = None,
                 extra: dict[str, str] | None = None, tokenizer: Any = None) -> Path:
    """Save the adapter (``PeftModel.from_pretrained`` loads it) and the run config beside it, so the
    prompt template that trained it travels with it; ``extra`` maps more file names to their text.
    A full fine-tune's model saves all its weights the same way (safetensors), with ``tokenizer``
    beside them so the folder loads with ``AutoModelForCausalLM.from_pretrained`` alone.

    Written into a temp folder beside ``directory`` and swapped in when complete: a failure half way
    (a full disk) leaves the adapter that was there before, whole.
    """
    import shutil

    directory = Path(directory)
    tmp = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if config is not None:
            config.save(tmp / "studio_config.yaml")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        sync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return replace_folder(tmp, directory)


def count_parameters(model: Any) -> tuple[int, int]:
    """(total, trainable) parameter counts; 4-bit weights count as their unpacked size."""
    total = trainable = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":
            n *= 2  # two 4-bit values packed per byte
        total += n
        if param.requires_grad:
            trainable += n
    return total, trainable


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _not_found(ref: str, exc: BaseException) -> str:
    return (f"{ref}: cannot load the model ({_first_line(exc)}); give a local folder with config.json, "
            f"or run 'studio pull {ref}' while online")
