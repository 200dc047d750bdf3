"""The rows bench/vram_measure.py measures, grid by grid: each row a model and a training setup.

- ``default``: the estimator's pinned grid (tests/data/vram_measured.json): four Llama and Qwen3
  shapes, both paths, 256-16384 tokens a micro-batch;
- ``families``: three to five rows on a small real shape of each family the fast path covers beside
  Llama and Qwen3 (issue 39; bench/family_shapes.py);
- ``moe``: mixtures of experts (issue 42): OLMoE-1B-7B whole, and Qwen3-30B-A3B and Mixtral-8x7B on a
  subset of their layers in their real shapes (bench/moe_shapes.py), three rows each, LoRA on the
  attention with and without the experts' own adapters. gpt-oss has no rows: the estimator does not
  describe it yet, so no prediction can be committed before the run.

A third of each grid's rows is out of sample (every third, and the family grid's fresh rows): the
estimator's constants are never fitted on them (bench/refit_vram_fast.py fits on the others).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from bench.family_shapes import FAMILY_MODELS, FAMILY_TINY
from bench.moe_shapes import MOE_MODELS, layer_subset, tiny

ROOT = Path(__file__).resolve().parents[1]

PINNED = ROOT / "tests" / "data" / "vram_measured.json"
PINNED_FAMILIES = ROOT / "tests" / "data" / "vram_measured_families.json"
"""Where ``--grid families`` writes by default (no test reads it yet)."""

MODELS = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen3-0.6B's config.json: per-head q/k norms, head_dim 128 over a 1024 stream, 16 query heads on 8 kv
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
"""The shapes measured (config.json values; RoPE's base is left at its default: memory does not
depend on it), smallest first: the order they are built in. The file keeps each saved config.json."""

TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
"""--cpu: a tiny shape of each family, standing in for its models (the tiny tokenizer's vocabulary)."""

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QV = ("q_proj", "v_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGET_NAMES = {ALL: "all", QV: "qv", ATTN: "attn"}
"""How a row's label names its LoRA targets."""


@dataclass(frozen=True)
class Row:
    """One measured run: a model and a training setup, the rest Studio's defaults."""

    model: str
    weights: str  # nf4, int8 or bf16
    r: int
    targets: tuple[str, ...]
    seq: int
    micro_batch: int
    checkpointing: bool = True
    dropout: float = 0.0
    optimizer: str = "adamw"
    data: str = "long"  # long: every example a full seq; short: the sample's instruction rows
    packing: bool = True
    out_of_sample: bool = False
    experts: bool = False  # a mixture of experts' own adapters too (lora.target_experts)

    @property
    def label(self) -> str:
        """``llama2-7b nf4 r16-all seq512 mb4 ckpt drop0.0 adamw``, with ``short-packed`` or ``short-padded``,
        and ``+experts`` after the targets where the experts have adapters."""
        return (f"{self.model} {self.weights} r{self.r}-{TARGET_NAMES.get(self.targets) or '+'.join(self.targets)}{'+experts' if self.experts else ''} "
                f"seq{self.seq} mb{self.micro_batch} {'ckpt' if self.checkpointing else 'no-ckpt'} drop{self.dropout} "
                f"{self.optimizer}{'' if self.data == 'long' else ' short-' + ('packed' if self.packing else 'padded')}")


def _rows() -> list[Row]:
    """Both paths (4-bit and bf16 bases take the fast one, Qwen3's included; 8-bit bases the plain
    one), 256-16384 tokens a micro-batch, graphed and eager fast steps, ranks 8-64 on q/v
    and on every projection, dropout, 8-bit AdamW, checkpointing off, long, packed and padded rows."""
    l2, l3, smol, qwen = "llama2-7b", "llama3-8b", "smollm2-135m", "qwen3-0.6b"
    rows = [
        Row(l2, "nf4", 16, ALL, 512, 1),
        Row(l2, "nf4", 16, ALL, 512, 4),
        Row(l2, "nf4", 16, ALL, 512, 16),  # 8192 tokens: an eager step
        Row(l2, "nf4", 8, QV, 2048, 1),
        Row(l2, "nf4", 64, ALL, 4096, 1),
        Row(l2, "nf4", 16, ALL, 1024, 4, dropout=0.05),
        Row(l2, "bf16", 16, QV, 1024, 2),
        Row(l2, "nf4", 16, ALL, 1024, 4, data="short", packing=False),
        Row(l2, "int8", 16, ALL, 512, 2),
        Row(l3, "nf4", 16, ALL, 512, 4),
        Row(l3, "nf4", 16, ALL, 2048, 1),
        Row(l3, "nf4", 16, ALL, 4096, 2),
        Row(l3, "nf4", 8, QV, 1024, 8, optimizer="adamw_8bit"),
        Row(l3, "nf4", 32, ALL, 512, 8, data="short"),
        Row(l3, "int8", 16, QV, 512, 1),
        Row(smol, "nf4", 16, ALL, 1024, 8, dropout=0.05),
        Row(smol, "nf4", 16, ALL, 2048, 4),
        Row(smol, "bf16", 64, ALL, 2048, 4, checkpointing=False),
        Row(smol, "nf4", 8, QV, 4096, 4),  # 16384 tokens
        Row(smol, "int8", 16, ALL, 512, 8),
        Row(smol, "int8", 8, QV, 1024, 2, checkpointing=False),
        Row(qwen, "nf4", 16, ALL, 1024, 4),
        Row(qwen, "bf16", 16, ALL, 512, 8, checkpointing=False),
        Row(qwen, "nf4", 8, QV, 2048, 2, dropout=0.05),
    ]
    return [replace(row, out_of_sample=i % 3 == 2) for i, row in enumerate(rows)]


ROWS = _rows()


def _family_rows() -> list[Row]:
    """Three rows a family (bench/family_shapes.py) as first measured (7ae829a), every third out of
    sample: NF4 and bf16 bases, 256-4096 tokens a micro-batch, ranks 8-64, q/v and every projection
    (Phi-3's fused modules take every projection only: q_proj and v_proj are not modules there),
    dropout, 8-bit AdamW. Where the estimator was since corrected on a family's measured rows, the rows
    it was fitted against count as in sample and the family has fresh rows out of sample (other
    lengths, micro-batches and ranks), at least a third of its rows: Gemma 3 and Gemma 2 (a GeGLU
    MLP's copies of gate and up), SmolLM3 and OLMo 2 (the evaluation after the last step, which no
    longer sits beside the graphs' pools)."""
    oos = {"out_of_sample": True}
    return [
        Row("qwen2.5-0.5b", "nf4", 16, ALL, 1024, 4),
        Row("qwen2.5-0.5b", "bf16", 16, QV, 512, 8),
        Row("qwen2.5-0.5b", "nf4", 32, ALL, 2048, 2, dropout=0.05, **oos),
        Row("gemma-3-1b", "nf4", 16, ALL, 2048, 2),
        Row("gemma-3-1b", "bf16", 8, QV, 1024, 4),
        Row("gemma-3-1b", "nf4", 16, ALL, 4096, 1),
        Row("gemma-3-1b", "nf4", 32, ALL, 1024, 2, **oos),
        Row("gemma-3-1b", "bf16", 16, ALL, 512, 8, **oos),
        Row("gemma-2-2b", "nf4", 16, ALL, 1024, 4),
        Row("gemma-2-2b", "nf4", 8, QV, 4096, 1),
        Row("gemma-2-2b", "bf16", 16, ALL, 512, 4),
        Row("gemma-2-2b", "nf4", 32, ALL, 2048, 1, **oos),
        Row("gemma-2-2b", "bf16", 8, QV, 1024, 2, **oos),
        Row("phi-4-mini", "nf4", 16, ALL, 1024, 4),
        Row("phi-4-mini", "bf16", 8, ALL, 512, 2),
        Row("phi-4-mini", "nf4", 32, ALL, 2048, 1, **oos),
        Row("olmo-2-1b", "nf4", 16, ALL, 2048, 2),
        Row("olmo-2-1b", "bf16", 16, QV, 1024, 4, dropout=0.05),
        Row("olmo-2-1b", "nf4", 64, ALL, 512, 8, **oos),
        Row("olmo-2-1b", "nf4", 32, ALL, 4096, 1, **oos),
        Row("smollm3-3b", "nf4", 16, ALL, 1024, 4),
        Row("smollm3-3b", "nf4", 8, QV, 4096, 1),
        Row("smollm3-3b", "bf16", 16, ALL, 2048, 1, **oos),
        Row("smollm3-3b", "nf4", 32, ALL, 2048, 2, **oos),
        Row("granite-3.1-2b", "nf4", 16, ALL, 1024, 4),
        Row("granite-3.1-2b", "bf16", 32, ALL, 512, 8),
        Row("granite-3.1-2b", "nf4", 8, QV, 2048, 2, **oos),
        Row("mistral-7b", "nf4", 16, ALL, 1024, 2),
        Row("mistral-7b", "nf4", 8, QV, 4096, 1),
        Row("mistral-7b", "nf4", 16, ALL, 512, 8, optimizer="adamw_8bit", **oos),
    ]


FAMILY_ROWS = _family_rows()

PINNED_MOE = ROOT / "tests" / "data" / "vram_measured_moe.json"
"""Where ``--grid moe`` writes by default (no test reads it yet)."""

MOE_SUBSETS = {"olmoe-1b-7b": ("olmoe-1b-7b", None), "qwen3-30b-a3b-l8": ("qwen3-30b-a3b", 8),
               "mixtral-8x7b-l4": ("mixtral-8x7b", 4)}
"""The MoE grid's models: the shape (bench/moe_shapes.py) and the layers built of it (None: all).
14, 11 and 12 GB of bf16: the three build in about a minute and fit the GPU box's disk together."""

MOE_GRID_MODELS = {name: layer_subset(MOE_MODELS[shape], layers) for name, (shape, layers) in MOE_SUBSETS.items()}
MOE_TINY = {shape["model_type"]: tiny(shape) for shape in MOE_GRID_MODELS.values()}
"""--cpu: a tiny shape of each MoE family, keyed by model_type."""


def _moe_rows() -> list[Row]:
    """Three rows a model, the third out of sample: NF4 (the experts packed in 4 bits) and one bf16 base,
    1024-4096 tokens a micro-batch, ranks 8-32, LoRA on the attention or q/v, the experts' own adapters
    on one row a model, dropout and 8-bit AdamW once each."""
    olmoe, qwen, mixtral = MOE_SUBSETS
    rows = [
        Row(olmoe, "nf4", 16, ATTN, 2048, 1),
        Row(olmoe, "bf16", 16, ATTN, 1024, 2),
        Row(olmoe, "nf4", 8, ATTN, 2048, 1, experts=True),
        Row(qwen, "nf4", 16, ATTN, 2048, 1),
        Row(qwen, "nf4", 16, ATTN, 2048, 1, experts=True),
        Row(qwen, "nf4", 32, ATTN, 4096, 1),
        Row(mixtral, "nf4", 16, ATTN, 2048, 1),
        Row(mixtral, "nf4", 8, QV, 1024, 2, dropout=0.05),
        Row(mixtral, "nf4", 16, ATTN, 1024, 1, optimizer="adamw_8bit", experts=True),
    ]
    return [replace(row, out_of_sample=i % 3 == 2) for i, row in enumerate(rows)]


MOE_ROWS = _moe_rows()

GRIDS = {"default": (ROWS, MODELS, TINY, PINNED), "families": (FAMILY_ROWS, FAMILY_MODELS, FAMILY_TINY, PINNED_FAMILIES),
         "moe": (MOE_ROWS, MOE_GRID_MODELS, MOE_TINY, PINNED_MOE)}
"""``--grid``: its rows, the shapes they train, the tiny shapes of ``--cpu`` and where the file goes."""

BARS = {"default": (0.03, 0.07), "families": (0.03, 0.07), "moe": (0.05, 0.05)}
"""``--grid``: the committed predictions' bar on peak reserved, (median, worst) absolute error over the
rows and over the out-of-sample ones (issue 39: 3% / 7%; issue 42: every MoE row within 5%)."""


