"""A decoder-only causal LM's layer described as data, built from its config.json.

- ``spec``: :class:`DecoderSpec` and its parts (norms and their placement, RoPE, each layer, the
  sparse MLP of mixture-of-experts layers: :class:`MoeSpec`);
- ``features``: what a decoder needs beyond a Llama layer, by name;
- ``values``: reading config.json the way transformers' config classes do;
- ``refusals``: what is not described (other mixture-of-experts families, state-space, encoder-decoder,
  unknown);
- ``families``: one entry per model_type, and :func:`describe_decoder`.

The estimator (core/model/info.py, core/memory/), the path decision (core/plan.py) and the fast
path (studio/engine/fast) read the same description. Plain Python: nothing here imports torch.
"""

from studio.core.decoder.families import FAMILIES, SUPPORTED, describe_decoder
from studio.core.decoder.features import DECODER_FEATURES, FEATURES, in_words
from studio.core.decoder.refusals import Refusal
from studio.core.decoder.spec import DecoderSpec, LayerSpec, MoeSpec, NormPlacement, NormSpec, RopeSpec

__all__ = ["DECODER_FEATURES", "FAMILIES", "FEATURES", "SUPPORTED", "DecoderSpec", "LayerSpec", "MoeSpec",
           "NormPlacement", "NormSpec", "Refusal", "RopeSpec", "describe_decoder", "in_words"]
