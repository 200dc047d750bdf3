"""A run's adapter merged into its base model's weights: what ``studio export --format merged`` saves
and the GGUF export converts. The merged model is the run's model in full precision, for every family
transformers loads as a causal LM (a multimodal checkpoint, Gemma 3 4B+, stays whole).

- The base loads unquantized on the CPU in the export's dtype, whatever the run trained it as: a QLoRA
  run's 4-bit weights were rounded from these, and merging into 4-bit weights would round the update
  away. A base that exists only as a bitsandbytes checkpoint (``quantization_config`` in its
  config.json) is dequantized first: its rounded weights are all there is. So are gpt-oss' experts,
  shipped in MXFP4 (``quant_method: mxfp4``), exactly.
- Each adapted weight is the float32 sum of base and update, rounded to the dtype once. A mixture of
  experts' expert weights (PEFT's ``target_parameters`` adapters) too: PEFT would round their update to
  the weight's dtype before adding it, so they are merged here, one projection in float32 at a time.
- Token embeddings and output head that share one tensor (tied) are split when the adapter changes
  either: merged into the shared tensor, an ``lm_head`` update would change the token embeddings too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from studio.engine.export import ExportError

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""A multimodal checkpoint's image processor files, copied beside the merged weights."""


def check_causal_lm(path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers config of the model at ``path`` (None where it cannot be read: the loader that
    follows says why); ExportError in one line when it is not a decoder-only causal LM (an
    encoder-decoder has no causal-LM class to merge into or embed with)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    if getattr(config, "is_encoder_decoder", False):
        raise ExportError(f"{path} is an encoder-decoder model (model_type {config.model_type!r}); Studio exports "
                          "and embeds decoder-only causal LMs")
    return config


def load_unquantized(path: str, dtype: torch.dtype, revision: str | None = None,
                     trust_remote_code: bool = False) -> Any:
    """The causal LM at ``path`` on the CPU in ``dtype``, its weights unquantized (a bitsandbytes
    checkpoint dequantized); ExportError in one line when that cannot be done here."""
    from transformers import AutoModelForCausalLM

    config = check_causal_lm(path, revision, trust_remote_code)
    quantized = getattr(config, "quantization_config", None)
    options = dict(dtype=dtype, revision=revision, trust_remote_code=trust_remote_code)
    if not quantized:
        return AutoModelForCausalLM.from_pretrained(path, **options)
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    if method == "mxfp4":
        # gpt-oss' experts ship as MXFP4 blocks: transformers decodes them into ``dtype`` (every MXFP4
        # value is exact in bfloat16 and float32), asked to so that a GPU with its kernels does not keep them.
        from transformers import Mxfp4Config

        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), **options)
        return _forget_load_conversions(model)
    if method != "bitsandbytes":  # a str (config.json) or transformers' str enum
        raise ExportError(f"{path} stores its weights quantized ({method}), which Studio cannot dequantize to merge "
                          "into; set model.base_model to its full-precision checkpoint")
    try:
        # On the CPU: bitsandbytes dequantizes there (its CPU backend), and a GPU may not hold the result.
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": "cpu"}, **options)
        model.dequantize()
        _forget_load_conversions(model)
    except Exception as exc:  # bitsandbytes raises many kinds; any of them means "not on this CPU"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ExportError(f"{path} is a bitsandbytes checkpoint and bitsandbytes could not dequantize it on the CPU "
                          f"({first}); update bitsandbytes, or set model.base_model to the full-precision "
                          "checkpoint") from None
    return model.to(dtype)


def _forget_load_conversions(model: Any) -> Any:
    """Drop transformers' record of how it converted a quantized checkpoint as it loaded it.

    transformers before 5.2x kept it after dequantizing, the quantizer's steps included; save_pretrained
    then tries to undo those and raises a bare NotImplementedError (seen with 5.17). Newer versions
    drop it there; without it the model's default mapping applies, as for a model made anew."""
    if hasattr(model, "_weight_conversions"):
        del model._weight_conversions
    return model


def untie_adapted_embeddings(model: Any) -> bool:
    """Give the output head its own copy of a weight it shares with the token embeddings when the
    adapter changes either of them; True when it did (the saved config then says untied)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or not (isinstance(inputs, BaseTunerLayer) or isinstance(outputs, BaseTunerLayer)):
        return False
    head = outputs.get_base_layer() if isinstance(outputs, BaseTunerLayer) else outputs
    table = inputs.get_base_layer() if isinstance(inputs, BaseTunerLayer) else inputs
    if head.weight is not table.weight:
        return False
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


def merge_adapter(model: Any, adapter: Path) -> Any:
    """``model`` with the PEFT adapter in ``adapter`` merged into its weights, returned as a plain
    transformers model. peft keeps the adapter in float32 over a bfloat16 / float16 base, so each merged
    weight is a float32 sum rounded to the base's dtype once."""
    import warnings

    from peft import PeftModel

    from studio.engine.model import names_as_written

    with warnings.catch_warnings(), names_as_written():
        # peft warns about tied embeddings in the adapter; untie_adapted_embeddings handles them.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # peft: is_gradient_checkpointing
        wrapped = PeftModel.from_pretrained(model, str(adapter))
    untie_adapted_embeddings(wrapped.get_base_model())
    merge_expert_adapters(wrapped)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All adapters are already merged")  # the experts, just above
        return wrapped.merge_and_unload()


def merge_expert_adapters(model: Any) -> None:
    """Merge the adapters on 3-D expert weights (PEFT's ``ParamWrapper``) of ``model`` into them, each
    a float32 sum rounded to the weight's dtype once. PEFT's own merge rounds the update to the
    weight's dtype first (a bfloat16 weight: rounded twice)."""
    from peft.tuners.lora.layer import ParamWrapper

    for module in model.modules():
        if not isinstance(module, ParamWrapper) or module.merged:
            continue
        param = module.get_param()
        dtype = param.dtype
        param.data = param.data.float()  # the update is then made in float32 and added there
        module.merge()
        param.data = param.data.to(dtype)


def copy_processor_files(base: str, dest: Path, revision: str | None = None) -> list[str]:
    """Copy the base's image processor files (:data:`PROCESSOR_FILES`) into ``dest``; their names."""
    import shutil

    from transformers.utils import cached_file

    copied = []
    for name in PROCESSOR_FILES:
        found = cached_file(base, name, revision=revision, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
        if found:
            shutil.copyfile(found, dest / name)
            copied.append(name)
    return copied
