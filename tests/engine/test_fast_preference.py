"""DPO and ORPO on the fast path (studio/engine/fast/): each answer's log-prob from the fused loss
equals the plain path's full-logits one, the reference pass through the same layers with the
adapters off is the base model's, and the DPO and ORPO losses and every LoRA gradient equal the
plain path's (CPU, fp32), also with the pair batch laid out as a CUDA graph takes it (DPO's reference
pass in the same layout, its graph sharing the policy graph's pool). On a CUDA GPU: liger's per-token
kernel, and the policy's pass and DPO's reference pass replayed as CUDA graphs on a pair batch's 2n
rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_fast_path import ALL, _examples, _peft_model

from studio.engine import fast
from studio.engine.batching import MicroBatch, collate
from studio.engine.fast.ops import Varlen
from studio.engine.preference import PreferenceObjective, sequence_logps

CPU = torch.device("cpu")


def _pairs_batch(model, packing: bool = False, seed: int = 2) -> MicroBatch:
    """Four rows (two pairs: chosen rows first) whose answers' tokens are in part the model's own
    argmax, so that the argmax hits an evaluation counts are not all zero. Packed: the four
    examples two a row (the segment sum then adds two answers a row, as the plain path does)."""
    examples = _examples([21, 14, 9, 17], seed=seed)
    units = [[examples[0], examples[1]], [examples[2], examples[3]]] if packing else [[e] for e in examples]
    batch = collate(units, pad_id=0, packing=packing).to(model.get_input_embeddings().weight.device)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    targets = batch.labels[:, 1:]
    argmax = logits[:, :-1].argmax(-1)
    every_other = torch.zeros_like(targets, dtype=torch.bool)
    every_other[:, ::2] = True
    targets[:] = torch.where((targets != -100) & every_other, argmax, targets)
    batch.label_tokens = batch.input_ids.shape[0] // 2
    return batch


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_each_answer_s_log_prob_equals_the_full_logits_one(tiny_model: Path, packing: bool, monkeypatch) -> None:
    """FastModel.sequence_logps against engine/preference.py's sequence_logps (full logits): the
    summed log-prob of each row's answer, its token count and, without gradients, its argmax hits;
    the vocabulary is gone through a few target rows at a time (no tokens x vocab logits)."""
    from studio.engine.fast import loss as fast_loss

    model = _peft_model(tiny_model, None, ALL)
    batch = _pairs_batch(model, packing)
    sums, counts, hits = sequence_logps(model, batch)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    chunks: list[int] = []
    monkeypatch.setattr(fast_loss, "chunk_rows", lambda *a: chunks.append(1) or 5)
    args = (batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    got, got_counts, _ = fast_model.sequence_logps(*args)
    assert got.requires_grad and len(chunks) == 1 and counts.sum() > 5, "one pass over the targets, in chunks"
    torch.testing.assert_close(got, sums, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_counts, counts) and counts.min() > 0
    with torch.no_grad():
        scored, scored_counts, scored_hits = fast_model.sequence_logps(*args)
    torch.testing.assert_close(scored, sums.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(scored_hits, hits) and hits.sum() > 0
    assert torch.equal(scored_counts, counts)


def test_the_reference_pass_is_the_base_model(tiny_model: Path) -> None:
    """``reference=True`` runs the same fast layers with every adapter off: the log-probs of the
    PEFT model with its adapter disabled, not the fine-tune's."""
    model = _peft_model(tiny_model, None, ALL)
    batch = _pairs_batch(model)
    with torch.no_grad(), model.disable_adapter():
        base = sequence_logps(model, batch)[0]
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    args = (batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    with torch.no_grad():
        reference = fast_model.sequence_logps(*args, reference=True)[0]
        policy = fast_model.sequence_logps(*args)[0]
    torch.testing.assert_close(reference, base, rtol=1e-5, atol=1e-5)
    assert (policy - reference).abs().min() > 1e-2, "the adapters move every answer's log-prob"


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_preference_losses_and_lora_gradients_equal_the_plain_path(tiny_model: Path, method: str) -> None:
    """The objective on the fast path (FastModel's log-probs, its reference pass) against the plain
    path (the PEFT model's logits, disable_adapter()): the same loss, ranking and gradient of every
    LoRA weight, ORPO's language-model term included."""
    model = _peft_model(tiny_model, None, ALL)
    batch = _pairs_batch(model)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    results = []
    for path in (None, fast_model):
        objective = PreferenceObjective(method, 0.1, model, CPU, torch.float32, encode=None)
        objective.fast = path
        model.zero_grad(set_to_none=True)
        loss, wins = objective.forward(batch)
        loss.backward()
        results.append((loss.detach(), wins, _lora_grads(model), objective.logged(1)))
    (plain, plain_wins, expected, plain_logged), (got, got_wins, grads, logged) = results
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    assert int(got_wins) == int(plain_wins)
    assert logged.reward_margin == pytest.approx(plain_logged.reward_margin, rel=1e-4, abs=1e-6)
    assert grads.keys() == expected.keys() and len(grads) == 2 * len(ALL) * 2  # A and B, 2 layers
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        rel = (grads[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def _varlen_on_the_cpu(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True):
    """flash-attention's varlen entry point as the CPU can run it: causal SDPA inside each example
    of the flat stream (empty examples, the layout's spare slots, have no token)."""
    bounds = cu_q.tolist()
    pieces = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                             is_causal=is_causal).transpose(0, 1)
              for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    return torch.cat(pieces)


class _LayoutsReplayedEagerly:
    """engine/fast/graphs.py's Graphs as far as the CPU goes: each step's batch is laid out as a
    captured graph would take it (FastModel._static_layout: the stream padded to 256 tokens, example
    slots in powers of two), then run eagerly; DPO's reference pass of a training step too (the
    layout's ReferenceGraph), with the adapters off."""

    failed = ""

    def __init__(self, fast_model):
        self.fast_model, self.layouts = fast_model, []

    def fit(self, total: int, slots: int, max_len: int) -> tuple[int, int]:
        return slots, max_len

    def run_reference(self, h, cos, sin, seg):
        assert not torch.is_grad_enabled()
        self.layouts.append(("reference", h.shape[1], seg.cu.numel() - 1, seg.max_len))
        return self.fast_model.stack(h, cos, sin, seg, reference=True)

    def run(self, h, cos, sin, seg):
        self.layouts.append(("policy", h.shape[1], seg.cu.numel() - 1, seg.max_len))
        return self.fast_model.stack(h, cos, sin, seg)


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_the_graphed_layout_takes_a_pair_batch(tiny_model: Path, method: str) -> None:
    """A pair batch's 2n padded rows as the CUDA-graph layout lays them out (one flat stream padded
    with examples that take no loss, spare example slots), on the CPU with varlen attention
    emulated: the same losses and LoRA gradients as the plain path. DPO's reference pass takes the
    same layout before the policy's (its graph shares the policy graph's pool); an evaluation's
    (under no_grad) runs eagerly and gives the same loss."""
    model = _peft_model(tiny_model, None, ALL)
    batch = _pairs_batch(model)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    varlen = Varlen(_varlen_on_the_cpu, {"is_causal": True}, gqa=False, scale=False, window=False)
    fast_model.varlen = varlen
    for layer in fast_model.layers:
        layer.varlen = varlen
    fast_model._graphs = _LayoutsReplayedEagerly(fast_model)
    results = []
    for path in (None, fast_model):
        objective = PreferenceObjective(method, 0.1, model, CPU, torch.float32, encode=None)
        objective.fast = path
        model.zero_grad(set_to_none=True)
        loss, _ = objective.forward(batch)
        loss.backward()
        results.append((loss.detach(), _lora_grads(model)))
    layout = (256, 32, 128)  # 4 rows of 61 tokens: one flat stream of 256, 32 slots
    passes = ["reference", "policy"] if method == "dpo" else ["policy"]
    assert fast_model._graphs.layouts == [(name, *layout) for name in passes]
    (plain, expected), (got, grads) = results
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # an evaluation: no step's layout, the reference pass eager
        scored, _ = objective.forward(batch)
    assert len(fast_model._graphs.layouts) == len(passes)
    torch.testing.assert_close(scored, plain, rtol=1e-5, atol=1e-6)
    for name, grad in expected.items():
        rel = (grads[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def _captured_eagerly(log: list):
    """graphs.py's ReferenceGraph with its capture and replay run eagerly (the CPU has no graphs):
    its own static inputs and copies, a pool token of its own; ``log`` records each capture."""
    from studio.engine.fast import graphs

    class CapturedEagerly(graphs.ReferenceGraph):
        def _capture(self) -> None:
            log.append(("reference", tuple(self.inputs[0].shape)))
            self.pool = object()

        def _replay(self) -> None:
            self.output = self._pass()

    return CapturedEagerly


def test_the_reference_graph_shares_its_layout_with_the_policy_graph(tiny_model: Path, monkeypatch) -> None:
    """engine/fast/graphs.py's own bookkeeping, captures replaced by eager calls: a DPO step captures
    its reference pass first, then the policy graph of the same layout into the reference graph's
    pool with its static inputs; later steps replay both (no capture), with the plain path's losses
    and LoRA gradients (through the gradient sink); release() drops both."""
    from studio.engine.fast import graphs

    model = _peft_model(tiny_model, None, ALL)
    model.enable_input_require_grads()  # as a 4-bit run's does (PEFT's k-bit preparation): a leaf h
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    varlen = Varlen(_varlen_on_the_cpu, {"is_causal": True}, gqa=False, scale=False, window=False)
    fast_model.varlen = varlen
    for layer in fast_model.layers:
        layer.varlen = varlen
    log: list = []

    def make_graphed_callables(module, sample, num_warmup_iters, pool):
        log.append(("policy", tuple(sample[0].shape), pool, sample))
        return module

    monkeypatch.setattr(graphs, "ReferenceGraph", _captured_eagerly(log))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    fast_model._graphs = graphs.Graphs(fast_model, offload=False)
    batches = [_pairs_batch(model, seed=s) for s in (2, 5)]
    results = []
    for path in (None, fast_model):
        objective = PreferenceObjective("dpo", 0.1, model, CPU, torch.float32, encode=None)
        objective.fast = path
        for batch in batches * 2:  # two steps of one micro-batch each, twice over
            model.zero_grad(set_to_none=True)
            loss, _ = objective.forward(batch)
            loss.backward()
            results.append((path, loss.detach(), _lora_grads(model)))
            del loss
    (reference_capture, policy_capture) = log
    reference = fast_model._graphs.references[(reference_capture[1], 33, 128)]
    assert reference_capture[0] == "reference" and policy_capture[0] == "policy"
    assert policy_capture[2] is reference.pool
    assert [x.data_ptr() for x in policy_capture[3]] == [x.data_ptr() for x in reference.inputs]
    assert [key[:3] for key in fast_model._graphs.graphed] == list(fast_model._graphs.references)
    plain = [r for r in results if r[0] is None]
    for (_, expected_loss, expected), (_, got, grads) in zip(plain, results[len(plain):], strict=True):
        torch.testing.assert_close(got, expected_loss, rtol=1e-5, atol=1e-6)
        for name, grad in expected.items():
            rel = (grads[name] - grad).norm() / grad.norm()
            assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"
    fast_model._graphs.release()
    assert not fast_model._graphs.graphed and not fast_model._graphs.references


def test_a_preference_session_trains_on_the_fast_path_and_says_so(tiny_model: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """With STUDIO_FAST_PATH=1 a DPO session builds the fast path, hands it to its objective and
    says so in ModelLoaded; its evaluation (the fine-tune's rows a few at a time, the reference
    pass, argmax hits of the chosen answers) gives the plain session's numbers."""
    from test_preference import _pair_config, _sample_module

    from studio.core import events as ev
    from studio.core.runs import create_run
    from studio.engine import preference as engine_preference
    from studio.engine.session import Session

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _sample_module().case_pairs(80)))
    config = _pair_config(tiny_model, data, tmp_path / "runs")
    config.trainer.eval_max_rows = 8
    # two rows a pass: a micro-batch of pairs is scored in several passes
    monkeypatch.setattr(engine_preference, "SCORE_TOKENS", 2 * config.data.max_seq_length)
    results = {}
    for env in ("0", "1"):
        monkeypatch.setenv(fast.FAST_PATH_ENV, env)
        events: list[ev.Event] = []
        session = Session(config, create_run(config), events.append)
        session.load()
        loaded = next(e for e in events if isinstance(e, ev.ModelLoaded))
        if env == "1":
            assert session.fast is not None and session.preference.fast is session.fast
            assert loaded.path == "fast" and "reference pass" in loaded.path_reason, loaded
        else:
            assert session.fast is None and loaded.path == "plain" and "STUDIO_FAST_PATH=0" in loaded.path_reason
        torch.manual_seed(1)
        with torch.no_grad():  # the same nudge of both sessions' (equal) fresh LoRA: policy != reference
            for p in (p for p in session.model.parameters() if p.requires_grad):
                p.add_(torch.randn_like(p) * 0.05)
        results[env] = (session.evaluate(), next(e for e in reversed(events) if isinstance(e, ev.PreferenceLogged)))
    (plain, plain_pref), (fused, fused_pref) = results["0"], results["1"]
    assert fused.rows == plain.rows == 8
    # float32 on the CPU: the same numbers; a GPU computes in bf16, whose rounding differs by path
    rel = 1e-5 if session.device.type == "cpu" else 5e-3
    assert fused.loss == pytest.approx(plain.loss, rel=rel) and abs(plain.loss - 0.6931) > 1e-3
    assert fused.perplexity == pytest.approx(plain.perplexity, rel=rel)
    # (in bf16 a near tie may pick another argmax)
    cpu = session.device.type == "cpu"
    assert fused.token_accuracy == pytest.approx(plain.token_accuracy, abs=1e-9 if cpu else 0.02)
    assert plain.token_accuracy > 0
    assert fused_pref.reward_margin == pytest.approx(plain_pref.reward_margin, rel=1e-4 if cpu else 5e-2, abs=0 if cpu else 1e-3)


# ------------------------------------------------------------------------------------ on a GPU


def test_liger_s_per_token_kernel_gives_the_torch_numbers_and_gradients(kernel_device) -> None:
    """loss.token_logps through liger's fused cross-entropy with reduction="none" (its per-token
    gradient folded in by its backward) against the chunked torch pass: the same log-probs and the
    same gradient to the hidden states, with and without gradients (the reference pass)."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    from studio.engine.fast import loss as fast_loss

    torch.manual_seed(0)
    h = torch.randn(37, 16, device=kernel_device, requires_grad=True)
    weight = torch.randn(50, 16, device=kernel_device)
    targets = torch.randint(0, 50, (37,), device=kernel_device)
    upstream = torch.randn(37, device=kernel_device)
    got = []
    for liger in ({"flce": LigerFusedLinearCrossEntropyFunction}, None):
        logps = fast_loss.token_logps(h, weight, targets, liger)
        (logps * upstream).sum().backward()
        got.append((logps.detach(), h.grad.clone()))
        h.grad = None
        with torch.no_grad():
            torch.testing.assert_close(fast_loss.token_logps(h, weight, targets, liger), logps.detach())
    (fused, fused_grad), (torch_logps, torch_grad) = got
    expected = torch.log_softmax(h.detach() @ weight.t(), -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch_logps, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, torch_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_the_graphed_policy_pass_equals_the_eager_one_on_pair_batches(tiny_model: Path, method: str) -> None:
    """A pair batch's 2n padded rows go through the graphed layout (one flat stream, example
    slots): DPO and ORPO steps replayed as CUDA graphs give the eager steps' losses and gradients,
    DPO's reference pass replayed as a graph of the same layout before them."""
    from studio.core.config import FastPathConfig

    model = _peft_model(tiny_model, 4, ALL, dtype=torch.bfloat16)
    device = next(p for p in model.parameters() if p.requires_grad).device
    model.to(device)
    batches = [_pairs_batch(model, seed=s) for s in (2, 5)]
    runs = []
    for options in (FastPathConfig(cuda_graphs=False), FastPathConfig()):
        fast_model, why = fast.prepare(model, options=options)
        assert fast_model is not None, why
        objective = PreferenceObjective(method, 0.1, model, device, torch.bfloat16, encode=None)
        objective.fast = fast_model
        losses, grads = [], []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            for batch in batches:
                loss, _ = objective.forward(batch)
                loss.backward()
                losses.append(loss.item())
                del loss
            grads.append(_lora_grads(model))
        runs.append((fast_model, losses, grads))
    (_, eager_losses, eager_grads), (graphed, graph_losses, graph_grads) = runs
    assert graphed._graphs is not None and not graphed.graphs_failed, graphed.graphs_failed
    assert graphed._graphs.graphed, "the policy's pass was captured"
    references = list(graphed._graphs.references)
    assert references == ([key[:3] for key in graphed._graphs.graphed] if method == "dpo" else []), references
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=2e-3, atol=2e-3)
    for step_eager, step_graph in zip(eager_grads, graph_grads, strict=True):
        for name, grad in step_eager.items():
            assert grad.abs().sum() > 0, name
            rel = (step_graph[name] - grad).norm() / grad.norm()
            assert rel < 2e-2, f"{name}: relative gradient error {rel:.2e}"  # bf16


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "phi3"])
def test_each_answer_s_log_prob_on_other_families(family: str) -> None:
    """The same per-answer log-probs and their gradients on families whose layers differ from
    Llama's: Gemma 2 (soft-capped attention and final logits: the per-answer log-probs go through
    the cap as the loss does), Qwen3 (q/k norms), Phi-3 (fused projections)."""
    from test_fast_families import _config, _peft

    model = _peft(_config(family))
    batch = _pairs_batch(model)
    sums, counts, _ = sequence_logps(model, batch)
    sums.sum().backward()
    expected = _lora_grads(model)
    model.zero_grad()
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    got, got_counts, _ = fast_model.sequence_logps(batch.input_ids, batch.labels, batch.attention_mask,
                                                   batch.position_ids)
    torch.testing.assert_close(got, sums.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_counts, counts)
    got.sum().backward()
    for name, grad in _lora_grads(model).items():
        assert expected[name].abs().sum() > 0, name
        rel = (grad - expected[name]).norm() / expected[name].norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"
