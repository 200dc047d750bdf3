"""Which part of Granite 3.1-2B's real shape breaks the fast step's CUDA-graph capture (a probe).

The family grid's Granite rows ran eager steps (h200_vram_families_7ae829a.json): the capture failed
in the backward with "operation would make the legacy stream depend on a capturing blocking stream"
(call A, 22nd session), while the tiny Granite of tests/engine/test_fast_graphs.py captures. The
tiny one differs from the real one in its head width (128 against 64), its vocabulary (the tiny
tokenizer's against 49,155, an odd number), its width and its micro-batch. Each case here builds
Granite's real layer shape on 2 layers with one of those changed, loads it as a run does (NF4, LoRA
r16 on every projection), runs two fast steps of 4 x 1024 packed tokens with CUDA graphs, and says
whether the capture failed and, with torch's sync debugging on, where. One process a case: a failed
capture can leave the process's CUDA state unusable.

    python3 bench/granite_capture.py --out granite_capture.json            # every case
    python3 bench/granite_capture.py --case real --out one.json             # one case, this process
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.family_shapes import FAMILY_MODELS  # noqa: E402

BASE = dict(FAMILY_MODELS["granite-3.1-2b"], num_hidden_layers=2)
LAYERS_40 = dict(num_hidden_layers=40)
NO_MULTIPLIERS = dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=0.125, logits_scaling=1.0)
CASES = {
    # rows of one full-length example each, as the grid's (no boundaries: torch's SDPA, not varlen)
    "full_rows": dict(rows="full"),
    "full_rows_sdpa_flash": dict(rows="full", attention="sdpa_flash"),
    "full_rows_varlen": dict(rows="full", attention="varlen"),
    "full_rows_head_dim_128": dict(rows="full", shape=dict(num_attention_heads=16, num_key_value_heads=4)),
    "full_rows_llama_same_sizes": dict(rows="full", shape="llama"),
    # rows of two examples packed (varlen): all captured at 10aa4aa / 759f732c
    "layers_40": dict(shape=LAYERS_40),
    "layers_40_no_offload": dict(shape=LAYERS_40, offload=False),
    "real": {},
    "llama_same_sizes": dict(shape="llama"),
    "no_multipliers": dict(shape=NO_MULTIPLIERS),
    "vocab_49152": dict(shape=dict(vocab_size=49152)),
    "head_dim_128": dict(shape=dict(num_attention_heads=16, num_key_value_heads=4)),
    "untied": dict(shape=dict(tie_word_embeddings=False)),
}
"""Each case: ``shape``, its change to Granite's real shape on 2 layers (``"llama"``: a Llama of
Granite's sizes: no multipliers, head width 64, the odd vocabulary, tied); ``rows``: ``packed`` (two
examples a row, the default) or ``full`` (one example a row: the grid's rows); ``attention``:
``default`` (the engine's choice), ``sdpa_flash`` (torch's SDPA held to its flash backend) or
``varlen`` (full rows through flash-attention's varlen kernel too, boundaries made on the device);
``offload``: ``trainer.fast_path.host_offload``."""


def _shape(case: str) -> dict:
    change = CASES[case].get("shape", {})
    if change == "llama":
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
        return dict(model_type="llama", **{k: BASE[k] for k in keep})
    return {**BASE, **change}


def _route_full_rows_to_varlen() -> None:
    """The probe's own patch of the layer's attention: rows without boundaries go to the varlen
    kernel as packed ones do (engine/fast/attention.py's ``_varlen`` makes their boundaries)."""
    from studio.engine.fast import attention, layer

    def attend(q, k, v, seg, varlen, span=attention.LLAMA, sinks=None):
        if varlen is not None and seg.cu is None and seg.mask is None and span.softcap is None and sinks is None:
            return attention._varlen(q, k, v, seg, varlen, span.scale, span.window)
        return attention.attend(q, k, v, seg, varlen, span, sinks)

    layer.attend = attend


def run_case(case: str, work: Path, tokens: int, rows: int) -> dict:
    """Build, load and step one case; what happened."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from bench.make_random_model import build_model
    from studio.core.config.sections import FastPathConfig
    from studio.engine import fast
    from studio.engine.batching import collate

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a check of this script only
    how = CASES[case]
    built = json.dumps(how.get("shape", {}), sort_keys=True)  # cases of one shape share its build
    name = "".join(c if c.isalnum() else "_" for c in built)[:60] or "real"
    folder = build_model(f"granite-probe-{name}", _shape(case), work / name)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": device})
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    rng = random.Random(0)
    batches = []
    for _ in range(2):
        units = []
        for _ in range(rows):
            cuts = (tokens,) if how.get("rows") == "full" else (rng.randrange(tokens // 4, 3 * tokens // 4),)
            lengths = cuts if len(cuts) == 1 and cuts[0] == tokens else (cuts[0], tokens - cuts[0])
            unit = []
            for n in lengths:
                ids = [rng.randrange(3, 1000) for _ in range(n)]
                unit.append(SimpleNamespace(input_ids=ids, labels=ids))
            units.append(unit)
        batches.append(collate(units, pad_id=0, packing=True).to(device))
    if how.get("attention") == "varlen":
        _route_full_rows_to_varlen()
    fast_model, why = fast.prepare(model, options=FastPathConfig(host_offload=how.get("offload", True)))
    if fast_model is None:
        return {"case": case, "error": f"no fast path: {why}"}
    if how.get("attention") == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel([SDPBackend.FLASH_ATTENTION]).__enter__()  # for the rest of this one-case process
    losses = []
    t0 = time.perf_counter()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        losses.append(loss.item())
        del loss
    out = {"case": case, "how": how, "losses": losses, "seconds": round(time.perf_counter() - t0, 1),
           "graphs_failed": fast_model.graphs_failed or None}
    if fast_model.graphs_failed and device == "cuda":
        fast_model.release_graphs()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = fast_model.loss(batches[0].input_ids, batches[0].labels, batches[0].attention_mask,
                                   batches[0].position_ids)
            loss.backward()
            out["sync_debug"] = "no synchronizing operation raised" + (
                f"; failed again: {fast_model.graphs_failed}" if fast_model.graphs_failed else "")
        except Exception:  # noqa: BLE001 - the traceback is the point
            out["sync_debug"] = traceback.format_exc()[-4000:]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", choices=sorted(CASES), help="one case in this process (default: each in its own)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/granite-probe"))
    parser.add_argument("--tokens", type=int, default=1024, help="tokens a row")
    parser.add_argument("--rows", type=int, default=4, help="rows a micro-batch")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args(argv)
    if args.case:
        try:
            result = run_case(args.case, args.work, args.tokens, args.rows)
        except Exception:  # noqa: BLE001 - the report says what failed
            result = {"case": args.case, "error": traceback.format_exc()[-4000:]}
        args.out.write_text(json.dumps(result, indent=1))
        return 0
    report = {"what": __doc__.splitlines()[0], "commit": args.commit, "command": " ".join(sys.argv),
              "tokens_a_row": args.tokens, "rows": args.rows, "cases": {}}
    for case in CASES:
        one = args.work / f"{case}.json"
        done = subprocess.run([sys.executable, __file__, "--case", case, "--out", str(one), "--work", str(args.work),
                               "--tokens", str(args.tokens), "--rows", str(args.rows)],
                              capture_output=True, text=True)
        report["cases"][case] = (json.loads(one.read_text()) if one.exists()
                                 else {"error": (done.stdout + done.stderr)[-3000:]})
        print(case, "->", report["cases"][case].get("graphs_failed") or report["cases"][case].get("error", "captured"),
              flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
