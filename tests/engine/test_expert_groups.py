"""4-bit experts lent to transformers' own forward (studio/engine/expert_weights.py), on the CPU:
without gradients (generation, chat, evaluation) an experts module runs a group of the experts its
tokens were routed to at a time and never holds more than a group's weights in 16 bits, answering
as the whole layer does; with gradients, or PEFT's expert adapter, the whole layer is lent, and
training and answering work. NF4 experts packed by quantize_experts (Qwen3-MoE, OLMoE, Mixtral,
gpt-oss) and gpt-oss' MXFP4 experts kept as shipped."""

from __future__ import annotations

import pytest
import torch
from helpers.gpt_oss import random_mxfp4
from test_fast_moe import ATTENTION, _config, _peft

from studio.engine import mxfp4
from studio.engine.expert_weights import lent_weights
from studio.engine.quantized_experts import PackedExperts, _quantize, packed_experts, quantize_experts

pytest.importorskip("bitsandbytes")

FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "gpt_oss"]
HOLDERS = [*FAMILIES, "gpt_oss-mxfp4"]
EXPERTS = 4
"""Experts in each sparse layer of test_fast_moe.py's tiny configs."""


class Dequantized:
    """The experts dimension of every 16-bit expert weight dequantized while patched in (NF4 and
    MXFP4 alike): each call writes one tensor ``[experts, ...]`` that stays alive until the
    module's forward is done with it."""

    def __init__(self, monkeypatch):
        from studio.engine.fast import frozen

        self.experts: list[int] = []
        packed, shipped = frozen.dequantize_packed, mxfp4.dequantize_mxfp4

        def dequantize_packed(values, state, out, kernel=None):
            self.experts.append(int(out.shape[0]))
            return packed(values, state, out, kernel)

        def dequantize_mxfp4(blocks, scales, dtype, out=None, kernel=True):
            self.experts.append(int(blocks.shape[0]))
            return shipped(blocks, scales, dtype, out, kernel)

        monkeypatch.setattr(frozen, "dequantize_packed", dequantize_packed)
        monkeypatch.setattr(mxfp4, "dequantize_mxfp4", dequantize_mxfp4)

    def take(self) -> list[int]:
        """What was dequantized since the last take."""
        taken, self.experts = self.experts, []
        return taken


def _held(model, holder: str):
    """``model``'s experts held in 4 bits: NF4 packed, or for ``gpt_oss-mxfp4`` random MXFP4 blocks
    and scales kept as a gpt-oss checkpoint ships them."""
    if holder != "gpt_oss-mxfp4":
        quantize_experts(model, "nf4", double_quant=True)
        return model
    for index, module in enumerate(m for m in model.modules() if type(m).__name__ == "GptOssExperts"):
        tensors = {}
        for offset, name in enumerate(("gate_up_proj", "down_proj")):
            experts, fan_in, fan_out = getattr(module, name).shape  # [experts, in, out]; MXFP4 rows are out
            tensors[name] = random_mxfp4((experts, fan_out, fan_in), seed=10 * index + offset)
        mxfp4.attach(module, tensors)
    return model


def _model(holder: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(holder.removesuffix("-mxfp4")), attn_implementation="eager")
    with torch.no_grad():  # transformers starts gpt-oss' expert biases at zero: a group must take its own
        for name, param in model.named_parameters():
            if name.endswith("_proj_bias"):
                param.normal_(std=0.1)
    return _held(model, holder).eval()


def _budget(monkeypatch, model, group: int) -> None:
    """Room for ``group`` experts' 16-bit weights (both projections) in a group."""
    module = next(m for m in model.modules() if lent_weights(m))
    expert = sum(w.placeholder[0].numel() * w.placeholder.element_size() for w in lent_weights(module).values())
    monkeypatch.setattr("studio.core.memory.expert_groups.EXPERT_GROUP_BYTES", group * expert + expert // 2)


def _ids(rows: int = 2, tokens: int = 16) -> torch.Tensor:
    return torch.randint(3, 300, (rows, tokens), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("holder", HOLDERS)
def test_an_answer_runs_groups_of_experts_and_equals_the_whole_layer(holder: str, group: int, monkeypatch) -> None:
    """No gradients: every dequantized expert tensor holds at most ``group`` experts, the layer's
    experts go through in several groups, and the logits are the whole layer's (the same forward
    with gradients on, which lends every expert at once: the instrument sees it)."""
    model = _model(holder)
    _budget(monkeypatch, model, group)
    seen = Dequantized(monkeypatch)
    with torch.enable_grad():
        whole = model(input_ids=_ids()).logits
    assert set(seen.take()) == {EXPERTS}
    hit: list[int] = []  # the experts each sparse layer's tokens were routed to
    for module in (m for m in model.modules() if lent_weights(m)):
        module.register_forward_pre_hook(lambda _, args: hit.append(int(args[1].unique().numel())))
    with torch.no_grad():
        grouped = model(input_ids=_ids()).logits
    sizes = seen.take()
    assert max(sizes) == group and max(hit) > group
    # each projection of each expert hit dequantized once, in ceil(hit / group) groups a layer
    assert sum(sizes) == 2 * sum(hit) and len(sizes) == 2 * sum(-(-n // group) for n in hit)
    torch.testing.assert_close(grouped, whole)
    for module in (m for m in model.modules() if lent_weights(m)):  # each parameter is its placeholder again
        assert module.num_experts == EXPERTS
        assert all(getattr(module, n) is w.param and w.param.untyped_storage().nbytes() <= 4
                   for n, w in lent_weights(module).items())


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_every_experts_implementation_of_transformers_answers_alike_in_groups(implementation: str,
                                                                             monkeypatch) -> None:
    """transformers' eager and batched_mm experts forwards (grouped_mm is the default, above) read
    ``num_experts`` and the biases of the group they are lent: gpt-oss, with biases and transposed weights."""
    model = _model("gpt_oss")
    model.set_experts_implementation(implementation)
    _budget(monkeypatch, model, 1)
    with torch.enable_grad():
        whole = model(input_ids=_ids()).logits
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, whole)


def test_a_decoding_step_dequantizes_only_the_experts_it_uses(monkeypatch) -> None:
    """One token goes to two experts of four: those two are dequantized, in one group, and no other."""
    model = _model("mixtral")
    seen = Dequantized(monkeypatch)
    with torch.no_grad():
        model(input_ids=_ids(rows=1, tokens=1))
    assert seen.take() == [2, 2] * 2  # gate/up and down of two experts, in each of two layers


@pytest.mark.parametrize("holder", ["mixtral", "gpt_oss", "gpt_oss-mxfp4"])
def test_with_gradients_the_whole_layer_is_lent_and_the_attention_s_adapter_learns(holder: str,
                                                                                   monkeypatch) -> None:
    """The plain training path: a step through transformers' forward with gradients dequantizes every
    expert at once and reaches every LoRA weight of the attention."""
    model = _peft(_config(holder.removesuffix("-mxfp4")), experts=False)
    _held(model, holder)
    _budget(monkeypatch, model, 1)
    seen = Dequantized(monkeypatch)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert set(seen.take()) == {EXPERTS}
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads) == 2 * len(ATTENTION) * model.config.num_hidden_layers
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("holder", ["qwen3_moe", "gpt_oss-mxfp4"])
def test_an_expert_adapter_answers_through_the_whole_layer(holder: str, monkeypatch) -> None:
    """PEFT's expert adapter (lora.target_experts) adds its delta to the whole parameter: the answer
    lends the whole layer and equals the forward with gradients; with the adapter off, the answer
    runs in groups again and differs."""
    model = _peft(_config(holder.removesuffix("-mxfp4")))
    _held(model, holder).eval()
    _budget(monkeypatch, model, 1)
    seen = Dequantized(monkeypatch)
    with torch.enable_grad():
        whole = model(input_ids=_ids()).logits
    seen.take()
    with torch.no_grad():
        answer = model(input_ids=_ids()).logits
    assert set(seen.take()) == {EXPERTS}
    torch.testing.assert_close(answer, whole)
    with torch.no_grad(), model.disable_adapter():
        without = model(input_ids=_ids()).logits
    assert max(seen.take()) == 1
    assert not torch.allclose(without, answer, atol=1e-3)


@pytest.mark.parametrize(("shape", "double_quant"), [((5, 8, 24), True), ((5, 8, 24), False), ((5, 6, 7), True)])
def test_a_group_s_nf4_weights_are_its_experts_of_the_whole_projection(shape: tuple[int, ...],
                                                                       double_quant: bool) -> None:
    """Any experts in any order: the rows of the whole projection's dequantization, whether each
    expert fills whole blocks (8 x 24 = 3 blocks, its bytes and scales read alone) or blocks straddle
    two experts (6 x 7: the whole projection dequantized, the experts taken)."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    packed, state = _quantize(weight, "nf4", double_quant)
    param = torch.nn.Parameter(torch.zeros(()).expand(shape), requires_grad=False)
    stored = PackedExperts(param, packed, state)
    whole = stored.parameter_weight(torch.float32)
    assert float((whole - weight).norm() / weight.norm()) < 0.11  # NF4's rounding: the right scales
    for chosen in ([3], [4, 0, 2], [1, 2, 3, 4, 0]):
        assert torch.equal(stored.parameter_weight(torch.float32, torch.tensor(chosen)), whole[chosen])


def test_a_group_s_mxfp4_weights_are_its_experts_in_the_parameter_s_layout() -> None:
    blocks, scales = random_mxfp4((4, 40, 64), seed=0)  # [experts, out, in]
    stored = mxfp4.Mxfp4Experts(torch.nn.Parameter(torch.zeros(()).expand(4, 64, 40)), blocks, scales)
    whole = stored.parameter_weight(torch.float32)
    assert whole.shape == (4, 64, 40) and whole.is_contiguous()
    assert torch.equal(whole, mxfp4.dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    assert torch.equal(stored.parameter_weight(torch.float32, torch.tensor([2, 0])), whole[[2, 0]])


def test_generation_answers_in_groups_as_the_dequantized_model_does(monkeypatch) -> None:
    """engine/generate.py's generate(): one expert at a time, the same tokens as the same model whose
    experts are plain 16-bit parameters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studio.engine.generate import generate
    from studio.engine.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    config = _config("olmoe")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config).eval()
    quantize_experts(model, "nf4", double_quant=True)
    for module, twin in zip(model.modules(), plain.modules(), strict=True):
        for name, packed in packed_experts(module).items():
            getattr(twin, name).data = packed.dequantize(torch.float32)
    _budget(monkeypatch, model, 1)
    seen = Dequantized(monkeypatch)
    prompt = _ids(rows=1)[0].tolist()
    answer = generate(model, tokenizer, prompt, max_new_tokens=8)
    assert seen.experts and max(seen.experts) == 1
    assert answer.token_ids == generate(plain, tokenizer, prompt, max_new_tokens=8).token_ids
