"""Bit-identity of the fast path's Llama-shaped runs across an engine change, on the CPU.

The fast path's speed on Llama-shaped models is the product's bar: a change that teaches the engine
other families must leave what a Llama runs untouched. This script trains one step of tiny random
Llama-shaped models (Llama with llama3 RoPE scaling, a Mistral without a window, a SmolLM2-style
tied Llama) through ``studio.engine.fast`` in every mode the CPU can run (fp32 and bf16, padded and
packed batches, adapter dropout, layer inputs kept on the host, a 4-bit base, evaluation's scores),
and saves every loss and every LoRA gradient (``--save``), or compares them with a saved file with
``torch.equal`` (``--check``). Run it on the tree before the change, then after:

    PYTHONPATH=<old tree> python bench/fast_identity.py --save /tmp/before.pt
    PYTHONPATH=<new tree> python bench/fast_identity.py --check /tmp/before.pt

With ``TRITON_INTERPRET=1`` (and Triton importable) Studio's own kernels (engine/fast/update.py,
norm.py) run in Triton's interpreter for the bf16 cases; run it once that way too.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from types import SimpleNamespace

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = {
    "llama3": dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", sliding_window=None, tie_word_embeddings=False),
    "smollm2": dict(model_type="llama", tie_word_embeddings=True),
}


def _model(name: str, dtype: torch.dtype, dropout: float, bits: int | None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MODELS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), hidden_size=64, intermediate_size=176,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=300, max_position_embeddings=256, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if bits == 4:
        import tempfile

        from transformers import BitsAndBytesConfig

        folder = tempfile.mkdtemp()
        model.save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype))
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=ALL))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    model.train()
    return model


def _batch(packing: bool, seed: int = 0):
    from studio.engine.batching import collate

    rng = random.Random(seed)
    rows = []
    for n in (21, 14, 9):
        ids = [rng.randrange(3, 300) for _ in range(n)]
        rows.append(SimpleNamespace(input_ids=ids, labels=[-100] * (n // 3) + ids[n // 3:]))
    if packing:
        return collate([rows[:2], rows[2:]], pad_id=0, packing=True)
    return collate([[r] for r in rows], pad_id=0, packing=False)


def run_case(name: str, dtype: torch.dtype, packing: bool, dropout: float, offload: bool,
             bits: int | None) -> dict[str, torch.Tensor]:
    """One training step's loss and gradients (and evaluation's scores) on the fast path."""
    from studio.engine import fast
    from studio.engine.fast import model as fast_model_module
    from studio.engine.fast.offload import HostInputs

    model = _model(name, dtype, dropout, bits)
    fm, why = fast.prepare(model)
    if fm is None:
        raise SystemExit(f"{name}: the fast path refused: {why}")
    fast_model_module.offload_for = lambda tokens, rate, cuda: offload
    fm._host = HostInputs(torch.device("cpu")) if offload else None
    batch = _batch(packing)
    torch.manual_seed(123)  # the dropout seed's draw
    out = {}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = fm.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        out[f"loss{step}"] = loss.detach().clone()
        for n, p in model.named_parameters():
            if p.requires_grad and p.grad is not None:
                out[f"step{step}:{n}"] = p.grad.detach().clone()
    model.eval()
    total, hits = fm.score(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    out["score"], out["hits"] = total.clone(), hits.clone()
    return out


def cases():
    for name in MODELS:
        for dtype in (torch.float32, torch.bfloat16):
            for packing in (False, True):
                for dropout in (0.0, 0.1):
                    for offload in (False, True):
                        yield name, dtype, packing, dropout, offload, None
    yield "llama3", torch.float32, True, 0.0, True, 4
    yield "llama3", torch.float32, False, 0.1, False, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save")
    parser.add_argument("--check")
    args = parser.parse_args()
    results = {}
    for case in cases():
        key = "/".join(str(c) for c in case)
        results[key] = run_case(*case)
    tag = f"interpreted={os.environ.get('TRITON_INTERPRET') == '1'}"
    if args.save:
        torch.save({"tag": tag, "results": results}, args.save)
        print(f"saved {len(results)} cases ({sum(len(r) for r in results.values())} tensors), {tag}")
        return
    saved = torch.load(args.check)
    if saved["tag"] != tag:
        raise SystemExit(f"saved with {saved['tag']}, checking with {tag}")
    bad = []
    for key, want in saved["results"].items():
        got = results[key]
        if got.keys() != want.keys():
            bad.append(f"{key}: tensors {sorted(set(got) ^ set(want))}")
            continue
        bad += [f"{key}: {name}" for name in want if not torch.equal(got[name], want[name])]
    total = sum(len(r) for r in saved["results"].values())
    if bad:
        print(f"{len(bad)} of {total} tensors differ:\n" + "\n".join(bad[:40]))
        sys.exit(1)
    print(f"bit-identical: {len(saved['results'])} cases, {total} tensors ({tag})")


if __name__ == "__main__":
    main()
