"""The output head a chunk of tokens at a time (studio/engine/chunked_head.py), on the CPU in fp32: for
every kind of output head the families have (a plain one, tied, Gemma 2's final soft-cap, Granite's
logits divisor, Gemma 3's decoder nested under a multimodal model), the chosen tokens' log-probs and
every LoRA gradient equal those from the model's own logits; and where it cannot stand in for them
(an output head that trains or carries an adapter) it says so and is not used."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_families import lora_targets, tiny_config

from studio.engine import chunked_head
from studio.engine.chunked_head import find_head
from studio.engine.fast import loss

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES = {
    "llama_tied": ("llama", {}),
    "mistral": ("mistral", {}),
    "gemma2_softcap": ("gemma2", {}),
    "granite_divisor": ("granite", {}),
    "phi3_fused": ("phi3", {}),
}


def _peft(config, targets: list[str] | str | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets or lora_targets(
        getattr(config, "text_config", config).model_type)))
    with torch.no_grad():  # B starts at zero in LoRA, which would make every A gradient zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model


def _multimodal_config():
    from transformers import AutoConfig

    text = tiny_config("gemma3", **IDS).to_dict()
    return AutoConfig.for_model("gemma3", text_config=text, mm_tokens_per_image=1, **IDS, vision_config=dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_hidden_layers=1, image_size=28, patch_size=14))


def _rows():
    """GRPO's scored rows: prompts left-padded, completions after them right-padded (lengths 7, 4, 1)."""
    g = torch.Generator().manual_seed(0)
    prompts, completions = [9, 5, 7], [7, 4, 1]
    width, length = max(prompts), max(completions)
    ids = torch.zeros((3, width + length), dtype=torch.long)
    attention = torch.zeros_like(ids)
    answer = torch.zeros((3, length), dtype=torch.bool)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[r, width - p:width + c] = torch.randint(3, 300, (p + c,), generator=g)
        attention[r, width - p:width + c] = 1
        answer[r, :c] = True
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return ids, attention, positions, answer


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(model, monkeypatch) -> None:
    head, why = find_head(model)
    assert head is not None, why
    monkeypatch.setattr(loss, "chunk_rows", lambda tokens, hidden, vocab: 3)  # several chunks of the 12 tokens
    ids, attention, positions, answer = _rows()
    length = answer.shape[1]
    weights = torch.randn(answer.shape, generator=torch.Generator().manual_seed(1))

    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
    expected = logits[:, -(length + 1):-1].log_softmax(-1).gather(-1, ids[:, -length:, None])[..., 0][answer]
    (expected * weights[answer]).sum().backward()
    expected_grads = _lora_grads(model)
    model.zero_grad(set_to_none=True)

    calls = []
    head.head.register_forward_hook(lambda *args: calls.append(args))
    hidden = head.hidden(ids, attention, positions)
    got = head.logps(hidden[:, -(length + 1):-1][answer], ids[:, -length:][answer], torch.float32)
    (got * weights[answer]).sum().backward()
    assert not calls  # the head's module never ran: no logits of every token
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got_grads = _lora_grads(model)
    assert got_grads.keys() == expected_grads.keys() and got_grads
    for name, grad in expected_grads.items():
        assert grad.abs().sum() > 0, name
        rel = (got_grads[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_the_chunked_head_gives_the_model_s_log_probs_and_lora_gradients(name: str, monkeypatch) -> None:
    family, overrides = CASES[name]
    config = tiny_config(family, **IDS, **overrides)
    _check(_peft(config), monkeypatch)


def test_the_decoder_nested_in_a_gemma_3_multimodal_model(monkeypatch) -> None:
    """Gemma3ForConditionalGeneration: the decoder at model.language_model, the head at the top."""
    targets = rf"model\.language_model\..*\.({'|'.join(lora_targets('gemma3_text'))})"
    model = _peft(_multimodal_config(), targets)
    assert find_head(model)[0].backbone is model.get_base_model().model.language_model
    _check(model, monkeypatch)


def test_an_output_head_that_trains_or_carries_an_adapter_is_left_to_the_model() -> None:
    """Full fine-tuning trains the head and a LoRA on lm_head wraps it: TokenLogps would give neither
    a gradient, so the scored pass takes the model's own logits (engine/grpo.py)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", **IDS, tie_word_embeddings=False)
    full = AutoModelForCausalLM.from_config(config)
    assert find_head(full) == (None, "the output head trains")
    with_head = _peft(config, ["q_proj", "lm_head"])
    head, why = find_head(with_head)
    assert head is None and "the output head is a" in why
    frozen = AutoModelForCausalLM.from_config(config).requires_grad_(False)
    assert isinstance(find_head(frozen)[0], chunked_head.ChunkedHead)
