"""Mixture-of-experts models on the fast path (studio/engine/fast/moe.py), on the CPU in fp32:
Qwen3-MoE, OLMoE, Mixtral and gpt-oss' loss and every LoRA gradient (attention, Qwen3-MoE's dense
MLP layers, and the experts' adapters as PEFT's target_parameters makes them) equal those of
transformers' own model wrapped by PEFT; the load-balancing loss equals transformers'; the grouped
product equals a product per expert; gpt-oss' clamped SwiGLU equals transformers'; MoE families
the fast path does not run are refused in one line. Tiny random configs with the tiny families'
sizes and their 300-id vocabulary."""

from __future__ import annotations

import pytest
import torch
from helpers.gpt_oss import GPT_OSS
from helpers.tiny_families import _SIZE
from test_fast_families import IDS, _assert_same, _batch, _check_family, _grads, _plain
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from studio.core.config import FastPathConfig
from studio.core.decoder import describe_decoder
from studio.core.plan import PathFacts, choose_path
from studio.engine import fast
from studio.engine.fast.build import path_facts
from studio.engine.fast.moe import ExpertProduct, ExpertWeights, Groups, kernel_takes
from studio.engine.model import names_as_written

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

CASES = {
    # four experts, two a token; Qwen3-MoE renormalising its top-k with a dense MLP in its middle layer
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                      norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "gpt_oss": GPT_OSS,
}

GATE_UP_GAIN = 10.0
"""gpt-oss' gate/up weights are scaled by this in the tests, so that the clamped SwiGLU's limit
(7) clamps some of the tiny model's values."""


def _config(name: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(name, vocab_size=300, **IDS, **{**_SIZE, **CASES[name], **overrides})


def _peft(config, experts: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if config.model_type == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(GATE_UP_GAIN)
    dense = ["gate_proj", "up_proj", "down_proj"] if config.model_type == "qwen3_moe" else []
    torch.manual_seed(1)
    with names_as_written():  # PEFT would read Qwen3-MoE's dense names as the experts' (engine/model.py)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION + dense,
                                                 target_parameters=EXPERTS if experts else None))
    with torch.no_grad():  # B starts at zero in LoRA, which would make every A gradient zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_path_gives_transformers_loss_and_lora_gradients(name: str, monkeypatch) -> None:
    """LoRA on attention and the experts (and Qwen3-MoE's dense MLP), padded and packed batches,
    torch's checkpointing and host-held layer inputs: the same loss and gradients."""
    model = _peft(_config(name))
    experts = [n for n, _ in model.named_parameters() if "experts" in n and "lora_A" in n]
    assert len(experts) == 2 * sum(s.sparse for s in describe_decoder(model.config.to_dict()).layers)
    _check_family(model, monkeypatch, padded_reference=name == "gpt_oss")


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_lora_on_attention_only_leaves_the_experts_frozen(name: str, monkeypatch) -> None:
    """Without target_parameters the experts train nothing and the attention's adapters still match."""
    model = _peft(_config(name), experts=False)
    _check_family(model, monkeypatch, padded_reference=name == "gpt_oss")
    fast_model, _ = fast.prepare(model)
    assert all(not layer.gate_up.a and not layer.down.a for layer in fast_model.layers)


class _Counted:
    """Counts, while the test patches them in, the calls of torch's sorting functions (the router's
    top-k, the sort by expert), the combines that sum the copies (``combine``; one whose value
    nothing reads is ``empty``) and each projection's dequantization of its experts
    (``ExpertWeights.stacked``; ``down``: the weights whose calls count as down's): into
    :attr:`forward`, or :attr:`backward` once it is ``counts``. Wrappers of the Python functions,
    not a TorchFunctionMode: torch's checkpointing recomputes a layer without the modes that were on."""

    NAMES = ("topk", "sort", "argsort")

    def __init__(self, monkeypatch, down: set[int]):
        from studio.engine.fast.expert_copies import Combine

        keys = (*self.NAMES, "combine", "empty", "gate_up", "down")
        self.forward = dict.fromkeys(keys, 0)
        self.backward = dict.fromkeys(keys, 0)
        self.counts = self.forward
        for name in self.NAMES:
            monkeypatch.setattr(torch, name, self._counting(lambda *_, n=name: n, getattr(torch, name)))
        monkeypatch.setattr(Combine, "forward", staticmethod(self._counting(
            lambda ctx, y, rows, pos, k, kernel, value=True, *_: "combine" if value else "empty", Combine.forward)))
        monkeypatch.setattr(ExpertWeights, "stacked", self._counting(
            lambda weights, part=None: "down" if id(weights) in down else "gate_up", ExpertWeights.stacked))

    def _counting(self, name_of, fn):
        def counted(*args, **kwargs):
            self.counts[name_of(*args)] += 1
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("host", [False, True], ids=["checkpointed", "host-held"])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_the_recomputation_takes_the_forward_s_routing_and_skips_down(name: str, host: bool, monkeypatch) -> None:
    """A training step runs each sparse layer's top-k and sort by expert once, in the forward: the
    layer's recomputation in the backward (torch's checkpointing, or the host-held layers' own)
    takes the routing the forward kept (routing.py's KeptRouting); and as nothing reads the recomputed
    output's value, the recomputation dequantizes gate/up's experts only, and neither runs down's
    product nor the combine. The loss and every LoRA gradient (attention and experts) are still
    transformers'."""
    from studio.engine.fast.offload import HostInputs

    model = _peft(_config(name))
    batch = _batch(packing=False)
    plain = _plain(model, batch)
    plain.backward()
    expected = _grads(model)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, rate, cuda: host)
    fast_model._host = HostInputs(torch.device("cpu")) if host else None
    model.zero_grad(set_to_none=True)
    counted = _Counted(monkeypatch, {id(layer.down.weights) for layer in fast_model.layers if layer.moe})
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    counted.counts = counted.backward
    loss.backward()
    n = sum(layer.moe is not None for layer in fast_model.layers)
    assert counted.forward == {"topk": n, "sort": n, "argsort": 0, "combine": n, "empty": 0, "gate_up": n, "down": n}
    # the recomputation's gate/up and the backward's two products
    assert counted.backward == {"topk": 0, "sort": 0, "argsort": 0, "combine": 0, "empty": n, "gate_up": 2 * n,
                                "down": n}
    adapters = sum(1 for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    _assert_same(loss, plain, _grads(model), expected, adapters)


@pytest.mark.parametrize("normed", [False, True], ids=["summed", "normed-after"])
def test_the_recomputation_computes_the_block_s_value_where_a_norm_reads_it(normed: bool, monkeypatch) -> None:
    """Where a norm after the block reads its output (a post-norm layer's), the recomputation must
    compute the value it otherwise skips: with torch's checkpointing and with the host-held layers,
    the loss and every LoRA gradient equal a step that recomputes nothing (the layers run as they
    are, the autograd graph kept); likewise where the output only joins the residual stream."""
    from studio.engine.fast.offload import HostInputs

    model = _peft(_config("qwen3_moe"))
    batch = _batch(packing=False)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    gen = torch.Generator().manual_seed(4)
    for layer in fast_model.layers:
        if layer.moe is not None and normed:
            layer.mlp_out = 1 + 0.3 * torch.randn(layer.down.weights.out_features, generator=gen)
    runs = {}
    for way in ("kept", "checkpointed", "host-held"):
        with monkeypatch.context() as m:
            if way == "kept":  # the layer itself in place of its checkpoint: nothing recomputed
                m.setattr("studio.engine.fast.model.checkpoint",
                          lambda fn, *args, use_reentrant, preserve_rng_state, **kwargs: fn(*args, **kwargs))
            m.setattr("studio.engine.fast.model.offload_for", lambda tokens, rate, cuda, on=way == "host-held": on)
            fast_model._host = HostInputs(torch.device("cpu")) if way == "host-held" else None
            model.zero_grad(set_to_none=True)
            loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
            loss.backward()
            runs[way] = (loss.detach(), _grads(model))
    want_loss, want = runs.pop("kept")
    for way, (loss, grads) in runs.items():
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        assert grads.keys() == want.keys() and want
        for key, grad in want.items():
            rel = (grads[key] - grad).norm() / grad.norm()
            assert rel < 1e-5, f"{way}, {key}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_the_checkpointed_block_gives_transformers_output_and_the_router_s_gradient(name: str) -> None:
    """One sparse block on a random normed stream, checkpointed as the stack runs it (its routing
    kept by the forward, taken by the recomputation), against transformers' block: the output,
    the stream's gradient, the experts' adapters' gradients and, with the frozen router made
    trainable here, the router's gradient (what flows back through the routing weights)."""
    from torch.utils.checkpoint import checkpoint

    from studio.engine.fast.routing import KeptRouting

    model = _peft(_config(name))
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    index = next(i for i, layer in enumerate(fast_model.layers) if layer.moe is not None)
    layer = fast_model.layers[index]
    block = model.get_base_model().model.layers[index].mlp
    router = layer.moe.router
    router.requires_grad_(True)
    trained = [router, *layer.gate_up.a, *layer.gate_up.b, *layer.down.a, *layer.down.b]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, router.shape[1], generator=gen)
    dout = torch.randn(x.shape, generator=gen)

    def grads(run) -> list[torch.Tensor]:
        for p in trained:
            p.grad = None
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)
        return [out.detach(), leaf.grad, *(p.grad for p in trained)]

    theirs = grads(block)
    fast_model.router.begin(x.shape[0] * x.shape[1])
    ours = grads(lambda leaf: checkpoint(layer.moe, leaf, layer.gate_up.adapters(), layer.down.adapters(),
                                         KeptRouting(), use_reentrant=False))
    router.requires_grad_(False)
    assert len(theirs) == 7
    for what, got, want in zip(("output", "stream", "router", "gate_up A", "gate_up B", "down A", "down B"),
                               ours, theirs, strict=True):
        assert want.abs().sum() > 0, what
        rel = (got - want).norm() / want.norm()
        assert rel < 1e-5, f"{what}: relative error {rel:.2e}"


def _kernel_step(model, batch, kernels: bool, monkeypatch) -> tuple[torch.Tensor, dict, dict]:
    """One training step of ``model`` on the fast path (torch's checkpointing, no CUDA graph): the
    loss, the gradients, and how many times each of the experts' kernels ran."""
    from studio.engine.fast import expert_activation, expert_copies

    calls = {"activation": 0, "copies_sum": 0}
    apply, summed = expert_activation.RoutedActivation.apply, expert_copies.copies_sum

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    with monkeypatch.context() as m:
        m.setattr(expert_activation.RoutedActivation, "apply", counted("activation", apply))
        m.setattr(expert_copies, "copies_sum", counted("copies_sum", summed))
        fast_model, why = fast.prepare(model, FastPathConfig(kernels=kernels, cuda_graphs=False))
        assert fast_model is not None, why
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
    return loss.detach(), _grads(model), calls


@pytest.mark.parametrize("name", list(CASES))
def test_the_experts_kernels_train_as_transformers_does(kernel_device, name: str, monkeypatch) -> None:
    """Each family's tiny model (fp32) with the experts' kernels (engine/fast/expert_activation.py,
    expert_copies.py; Triton's interpreter on the CPU): per sparse layer the activation's kernel
    in the forward and the recomputation, the copies' sum in the forward's combine and twice in the
    backward (the routing weights' and the stream's gathers); transformers' loss and every LoRA
    gradient (attention, Qwen3-MoE's dense MLP, the experts' adapters, and through the routing
    weights the stream's). With the kernels off, torch's operations give the same, no kernel run."""
    pytest.importorskip("triton")
    from studio.engine.fast import expert_activation, expert_copies

    model = _peft(_config(name)).to(kernel_device)
    batch = _batch(packing=False).to(kernel_device)
    plain = _plain(model, batch)
    plain.backward()
    expected = _grads(model)
    adapters = sum(1 for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    n = sum(s.sparse for s in describe_decoder(model.config.to_dict()).layers)
    loss, grads, calls = _kernel_step(model, batch, True, monkeypatch)
    assert calls == {"activation": 2 * n, "copies_sum": 3 * n}
    assert not expert_activation.KERNELS.broken and not expert_copies.KERNELS.broken
    _assert_same(loss, plain, grads, expected, adapters)
    loss, grads, calls = _kernel_step(model, batch, False, monkeypatch)
    assert calls == {"activation": 0, "copies_sum": 0}
    _assert_same(loss, plain, grads, expected, adapters)


def test_gpt_oss_is_described_with_every_trait_it_has() -> None:
    """The tiny gpt-oss' description has what the equivalence test must exercise: sinks, biases on
    q/k/v/o, a sliding window shorter than the rows, the router's bias and order, the experts'
    biases, interleaved gate/up and clamped SwiGLU; its packed examples are kept apart, as the same
    examples padded (transformers' gpt-oss attends across them: the test's reference is padded)."""
    model = _peft(_config("gpt_oss"))
    spec = describe_decoder(model.config.to_dict())
    assert {"attention_sinks", "linear_bias", "sliding_window", "router_bias", "topk_softmax", "expert_bias",
            "clamped_swiglu", "interleaved_gate_up", "norm_cast_after_scale"} <= spec.features
    assert spec.head_dim * spec.heads != spec.hidden and spec.layers[0].rope.kind == "yarn"
    fast_model, _ = fast.prepare(model)
    padded, packed = _batch(False), _batch(True)
    with torch.no_grad():
        torch.testing.assert_close(
            fast_model.loss(packed.input_ids, packed.labels, packed.attention_mask, packed.position_ids),
            fast_model.loss(padded.input_ids, padded.labels, padded.attention_mask, padded.position_ids))


def test_attention_with_sinks_in_blocks_of_queries_is_the_same(monkeypatch) -> None:
    """Scores in blocks of a few queries (against the keys within the sliding window, or every earlier
    one) and example by example, as a long micro-batch computes them: the same loss and gradients."""
    monkeypatch.setattr("studio.engine.fast.attention.EAGER_SCORES", 2 * 5 * 44)  # about 5 queries a block
    _check_family(_peft(_config("gpt_oss")), monkeypatch, padded_reference=True)


def test_the_clamped_swiglu_is_transformers_own() -> None:
    """Gate and up values on both sides of the limit, interleaved as gpt-oss stores them: the fast
    MLP's activation equals GptOssExperts' (its own ``_apply_gate``), in value and gradient."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from studio.engine.fast.moe import SparseMlp

    config = _config("gpt_oss")
    experts = GptOssExperts(config)
    spec = describe_decoder(config.to_dict()).moe
    mlp = SparseMlp(torch.zeros(4, 64), None, None, spec, None, 0)
    gu = (torch.randn(16, 2 * config.intermediate_size) * 8).requires_grad_()
    assert (gu[:, 0::2] > 7).any() and (gu[:, 1::2].abs() > 7).any() and (gu[:, 0::2] < -7).any()
    ours = mlp.activate(gu)
    ours.backward(torch.ones_like(ours))
    ours_grad, gu.grad = gu.grad, None
    theirs = experts._apply_gate(gu)
    theirs.backward(torch.ones_like(theirs))
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_grad, gu.grad)


@pytest.mark.parametrize("packing", [False, True])
def test_the_load_balancing_loss_is_transformers(packing: bool) -> None:
    """trainer.router_aux_loss_coef adds transformers' load_balancing_loss_func (its padding mask
    included) to the loss, with its gradient; None follows the model's config, where
    output_router_logits turns it on."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = _config("olmoe", output_router_logits=True, router_aux_loss_coef=0.5)
    model = _peft(config)
    batch = _batch(packing)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                labels=batch.labels, use_cache=False)
    out.loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    fast_model, why = fast.prepare(model, router_aux_loss_coef=None)  # the config's 0.5
    assert fast_model is not None, why
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    _assert_same(loss, out.loss, _grads(model), expected, 6 * 2)  # 4 attention, 2 experts a layer
    aux = fast_model.router.balance_loss()
    torch.testing.assert_close(aux, out.aux_loss, rtol=1e-5, atol=1e-6)
    mask = None if packing else batch.attention_mask
    torch.testing.assert_close(aux, load_balancing_loss_func(out.router_logits, 4, 2, mask), rtol=1e-5, atol=1e-6)
    # off: the cross-entropy alone
    plain_ce = _plain(_peft(_config("olmoe")), batch)
    off, _ = fast.prepare(model, router_aux_loss_coef=0.0)
    torch.testing.assert_close(off.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids),
                               plain_ce, rtol=1e-5, atol=1e-6)


def test_each_expert_s_tokens_are_counted_for_the_step() -> None:
    """Every real token (padding removed) goes to top_k experts in each sparse layer: the step's
    counts sum to that."""
    model = _peft(_config("qwen3_moe"))
    fast_model, _ = fast.prepare(model)
    batch = _batch(packing=False)
    fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids).backward()
    tokens = fast_model.take_expert_tokens()
    assert len(tokens) == 4 and sum(tokens) == int(batch.attention_mask.sum()) * 2 * 2  # two sparse layers
    assert fast_model.take_expert_tokens() == [0, 0, 0, 0]


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 9, 7, 0], [300, 0, 0, 0]],
                         ids=["empty-between", "empty-first-and-last", "one-takes-all"])
@pytest.mark.parametrize(("device", "dtype"), [
    ("cpu", torch.float32), ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA GPU"))])
def test_the_grouped_product_equals_a_product_per_expert(device: str, dtype: torch.dtype, counts: list[int]) -> None:
    """torch's grouped kernel against the per-expert loop: the product, the input's gradient and
    the adapters', for sorted rows of four experts, with experts that got no tokens between, before
    and after the others, and one expert taking every row (the routing of a random one-layer model's
    own stream: bench/moe_layer_profile.py's skewed_block). On CUDA, the grouped kernel a GPU run
    takes (bf16)."""
    torch.manual_seed(0)
    counts = torch.tensor(counts, device=device)
    rows, experts, d_in, d_out, r = int(counts.sum()), 4, 64, 32, 8
    weights = ExpertWeights(torch.randn(experts, d_out, d_in, device=device), dtype)
    x = torch.randn(rows, d_in, dtype=dtype, device=device)
    a = (torch.randn(experts, r, d_in, device=device) * 0.1).to(dtype)
    b = (torch.randn(experts, d_out, r, device=device) * 0.1).to(dtype)
    dy = torch.randn(rows, d_out, dtype=dtype, device=device)
    assert kernel_takes(x, weights.stacked().transpose(1, 2))  # torch's grouped kernel runs here
    results = []
    for loop in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, a, b)]
        y = ExpertProduct.apply(leaves[0], weights, Groups(counts.cumsum(0).to(torch.int32), loop=loop), leaves[1], leaves[2], 2.0)
        y.backward(dy)
        results.append([y.detach(), *(t.grad for t in leaves)])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for grouped, looped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, looped, **tol)
    # and the loop against the definition, expert by expert
    w = weights.stacked().float()
    start = 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n].float()
        ref = xe @ w[e].t() + 2.0 * xe @ a[e].float().t() @ b[e].float().t()
        torch.testing.assert_close(results[1][0][start:start + n].float(), ref, **tol)
        start += n
    for e in (counts == 0).nonzero().flatten().tolist():  # an expert without tokens gets no gradient
        assert results[0][2][e].abs().sum() == 0 and results[0][3][e].abs().sum() == 0


@pytest.mark.parametrize(("model_type", "settings", "words"), [
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "shared expert")])
def test_moe_families_without_a_fast_mlp_are_refused_in_one_line(model_type: str, settings: dict,
                                                                  words: str) -> None:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(model_type, vocab_size=100, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, **settings)
    fast_model, why = fast.prepare(AutoModel.from_config(config))
    assert fast_model is None
    assert why.startswith(f"{model_type}: mixture-of-experts") and words in why and "\n" not in why, why


@pytest.mark.parametrize(("name", "settings", "words"), [
    ("mixtral", dict(router_jitter_noise=0.1), "router jitter noise"),
    ("olmoe", dict(clip_qkv=8.0), "clipped q/k/v")])
def test_what_the_fast_mlp_does_not_run_keeps_the_plain_path(name: str, settings: dict, words: str) -> None:
    fast_model, why = fast.prepare(_peft(_config(name, **settings)))
    assert fast_model is None and words in why and "\n" not in why, why


def test_the_path_decision_graphs_moe_steps_except_with_the_balance_loss() -> None:
    """On a GPU (as the estimator decides it): expert adapters are fast-path targets; a mixture of
    experts' steps are CUDA graphs with the layer inputs on the host; the load-balancing loss, or a
    card without the grouped product in the compute dtype, makes them eager, and says why."""
    model = _peft(_config("mixtral"))
    facts = path_facts(model, torch.device("cpu"))
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(facts.lora_targets) and facts.grouped_products
    on_gpu = choose_path(PathFacts(**{**facts.__dict__, "cuda": True}))
    assert on_gpu.path == "fast" and on_gpu.cuda_graphs and on_gpu.host_offload and not on_gpu.eager
    balanced = choose_path(PathFacts(**{**path_facts(model, torch.device("cpu"), router_aux_loss_coef=0.01).__dict__,
                                        "cuda": True}))
    assert balanced.path == "fast" and not balanced.host_offload and not balanced.cuda_graphs
    assert "load-balancing loss" in balanced.reason, balanced.reason
    looped = choose_path(PathFacts(**{**facts.__dict__, "cuda": True, "grouped_products": False}))
    assert not looped.cuda_graphs and "grouped product" in looped.reason, looped.reason


_FLASH_EMULATED = [False]
"""True while the CPU's stand-in for flash-attention's varlen kernel runs: it reads the example
bounds on the host, which the real kernel does not (the modes below let it)."""


def _flash_on_the_cpu(*args, **kwargs):
    from test_fast_preference import _varlen_on_the_cpu

    _FLASH_EMULATED[0] = True
    try:
        return _varlen_on_the_cpu(*args, **kwargs)
    finally:
        _FLASH_EMULATED[0] = False


class _NoHostReads(TorchDispatchMode):
    """Raises where an operation reads a tensor's values back to the host or makes a shape of
    them (``.item()``, ``nonzero``, a boolean mask's indexing): what a CUDA graph cannot capture."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = [a for a in (args[1] if func is torch.ops.aten.index.Tensor else ())
                 if isinstance(a, torch.Tensor) and a.dtype == torch.bool]
        if not _FLASH_EMULATED[0] and (
                func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default) or masks):
            raise AssertionError(f"host read: {func}")
        return func(*args, **(kwargs or {}))


class _NoHostCalls(TorchFunctionMode):
    """Raises on the Python calls that read a tensor to the host without an aten operation."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not _FLASH_EMULATED[0] and func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
                                               torch.Tensor.__int__):
            raise AssertionError(f"host read: {func.__name__}")
        return func(*args, **(kwargs or {}))


def _stack_step(fast_model, tokens: int = 40):
    """One forward and backward of the decoder stack (what a CUDA graph captures) on random tokens,
    the adapters' gradients into a gradient sink as in a captured step; returns the output."""
    from studio.engine.fast.graphs import GradSink
    from studio.engine.fast.layer import Segments

    ids = torch.randint(3, 300, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens)[None]
    h = fast_model._embed(ids).requires_grad_()
    cos, sin = fast_model._rope(h, pos)
    fast_model.router.begin(tokens)
    out = fast_model.stack(h, cos, sin, Segments(), sink=GradSink(fast_model.trainable()))
    out.float().square().mean().backward()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_a_sparse_layer_reads_nothing_back_to_the_host(name: str) -> None:
    """The CPU's proof that a CUDA graph can capture the stack: its forward and backward (each
    layer recomputed in the backward) make no ``.item()``, ``.tolist()``, ``nonzero`` or boolean-mask
    indexing; the per-expert loop, which reads each expert's rows, is caught doing so."""
    fast_model, why = fast.prepare(_peft(_config(name)))
    assert fast_model is not None, why
    with _NoHostReads(), _NoHostCalls():
        _stack_step(fast_model)
    sparse = [layer.moe for layer in fast_model.layers if layer.moe is not None]
    for mlp in sparse:
        mlp.loop = True
    with pytest.raises(AssertionError, match="host read"), _NoHostReads(), _NoHostCalls():
        _stack_step(fast_model)


class _GraphedLayouts:
    """engine/fast/graphs.py's Graphs as far as the CPU goes: the batch laid out as a captured graph
    takes it (FastModel._static_layout: one stream padded to 256 tokens with padding examples), the
    adapters' gradients into a gradient sink, and the stack run without host reads."""

    failed = ""

    def __init__(self, fast_model):
        from studio.engine.fast.graphs import GradSink

        self.fast_model, self.layouts = fast_model, []
        self.sink = GradSink(fast_model.trainable())

    def fit(self, total: int, slots: int, max_len: int) -> tuple[int, int]:
        return slots, max_len

    def run(self, h, cos, sin, seg):
        self.layouts.append(h.shape[1])
        self.sink.bind()
        with _NoHostReads(), _NoHostCalls():
            return self.fast_model.stack(h, cos, sin, seg, sink=self.sink)


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe"])
def test_the_graphed_layout_gives_the_eager_loss_gradients_and_expert_counts(name: str) -> None:
    """A packed micro-batch as a CUDA graph runs it (padded to 256 tokens: padding examples routed
    through the experts too), on the CPU with varlen attention emulated: the eager step's loss and
    LoRA gradients, and each expert's tokens counted for the real tokens only."""
    from studio.engine.fast.ops import Varlen

    model = _peft(_config(name))
    batch = _batch(packing=True)
    results = []
    for graphed in (False, True):
        fast_model, why = fast.prepare(model)
        assert fast_model is not None, why
        varlen = Varlen(_flash_on_the_cpu, {"is_causal": True}, gqa=False, scale=False, window=False)
        fast_model.varlen = varlen
        for layer in fast_model.layers:
            layer.varlen = varlen
        if graphed:
            fast_model._graphs = _GraphedLayouts(fast_model)
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model), fast_model.take_expert_tokens()))
    assert fast_model._graphs.layouts == [256]
    (eager, expected, eager_tokens), (got, grads, tokens) = results
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected.keys() and expected
    for key, grad in expected.items():
        rel = (grads[key] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{key}: relative gradient error {rel:.2e}"
    sparse = sum(s.sparse for s in describe_decoder(model.config.to_dict()).layers)
    real = batch.input_ids.numel() if batch.attention_mask is None else int(batch.attention_mask.sum())
    assert tokens == eager_tokens and sum(tokens) == real * 2 * sparse, (tokens, eager_tokens, real)


def test_the_counts_are_written_in_place_where_a_replay_finds_them() -> None:
    """A captured forward's replay runs no Python: the counts must go into the same tensor every
    forward. Two forwards of different routing: the tensor is the same object, holding the second."""
    fast_model, _ = fast.prepare(_peft(_config("mixtral")))
    counts = fast_model.router.counts
    address = counts.data_ptr()
    with torch.no_grad():
        first = _batch(packing=False)
        fast_model.loss(first.input_ids, first.labels, first.attention_mask, first.position_ids)
        before = counts.clone()
        second = _batch(packing=False, seed=5)
        fast_model.loss(second.input_ids, second.labels, second.attention_mask, second.position_ids)
    assert fast_model.router.counts is counts and counts.data_ptr() == address
    assert not torch.equal(counts, before) and counts.sum() == int(second.attention_mask.sum()) * 2 * 2


@pytest.mark.parametrize("name", list(CASES))
def test_the_estimator_counts_the_parameters_transformers_builds(name: str) -> None:
    """core/model/info.py's view of the config: every parameter of transformers' model (experts,
    routers and Qwen3-MoE's dense layer), and the linear modules a LoRA on all-linear adapts."""
    from transformers import AutoModelForCausalLM

    from studio.core.model.info import from_config_dict

    config = _config(name)
    info = from_config_dict(config.to_dict(), name)
    model = AutoModelForCausalLM.from_config(config)
    assert info.total_params() == sum(p.numel() for p in model.parameters())
    assert info.expert_params() == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    assert set(info.lora_targets("all-linear")) == linear
