"""GRPO on the tiny model, on the CPU: the batched sampler, the token log-probs, the losses, and a run
that learns a checkable task from rewards alone; exact resume, out-of-memory halving, a failing
reward (one line, a checkpoint, resume after the fix) and two processes that train what one does.

The task is the bundled sample (sample_data/grpo/): repeat a five-letter word written with dashes.
The tiny model was pre-trained to copy words, but at temperature 1 its copies are sloppy (about 2%
exact); the rewards (exact match on the ``word`` column, and sample_data/grpo/rewards.py's
``letters_right`` for partial credit) are all it learns from.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import subprocess
import weakref
from pathlib import Path

import pytest
import torch
from helpers.cli import run_studio
from helpers.engine import engine_on_cpu

from studio.core import events as ev
from studio.core.config import RewardConfig, RunConfig
from studio.core.paths import sample_data_dir
from studio.core.runs import RunDir, create_run, iter_events
from studio.engine.sampler import GroupSampler, SlotCache, choose, vocab_hashes
from studio.engine.tiny import TINY_TEMPLATE
from studio.engine.token_logps import token_logps

pytestmark = pytest.mark.usefixtures("on_cpu")  # thresholds calibrated in fp32 (conftest.on_cpu)

SAMPLE = sample_data_dir() / "grpo"
PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
"""The tiny model's template (engine/tiny.py) up to the response: a GRPO prompt has no answer."""


def _config(tiny_model: Path, out: Path, data: Path | None = None, steps: int = 40) -> RunConfig:
    config = RunConfig()
    config.model.base_model = str(tiny_model)
    config.quantization.bits = None
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    assert TINY_TEMPLATE.startswith(PROMPT)
    config.prompt.template = PROMPT
    config.data.path = str(data or SAMPLE / "copy_words.jsonl")
    config.data.max_seq_length = 64
    t = config.trainer
    t.method, t.learning_rate, t.max_steps, t.scheduler, t.warmup_fraction = "grpo", 5e-3, steps, "constant", 0.0
    t.micro_batch_size = t.effective_batch_size = 8
    t.gradient_checkpointing, t.packing = False, False
    t.eval_interval, t.eval_max_rows, t.checkpoint_interval, t.log_interval = 0, 16, 0, 1
    g = config.grpo
    g.num_generations, g.max_completion_length = 8, 16
    g.rewards = [RewardConfig(name="exact_match", column="word"),
                 RewardConfig(name=f"{SAMPLE / 'rewards.py'}:letters_right")]
    config.output_dir = str(out)
    return config


def _model(tiny_model: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def _prompts(tokenizer, words: list[str]) -> list[list[int]]:
    return [[tokenizer.bos_token_id] + tokenizer.encode(PROMPT.format(instruction="Repeat the letters of the word.",
                                                                      input=w), add_special_tokens=False)
            for w in words]


# ------------------------------------------------------------------------------------ sampling


def test_batched_greedy_sampling_is_what_step_by_step_decoding_gives(tiny_model: Path) -> None:
    """Prompts of different lengths, left-padded into one batch with the slot KV cache: each row's
    greedy completion is the one the model gives that prompt alone, token by token, without a cache."""
    model, tok = _model(tiny_model)
    prompts = _prompts(tok, ["s-t-o-n-e", "a-b", "q-u-i-c-k-l-y"])
    sampler = GroupSampler(model, torch.device("cpu"), tok.pad_token_id, [tok.eos_token_id], torch.float32)
    got = sampler.sample(prompts, [0, 1, 2], seed=0, max_new=12, temperature=0.0)
    for row, prompt in enumerate(prompts):
        ids, expected = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(12):
                token = int(model(ids).logits[0, -1].argmax())
                expected.append(token)
                if token == tok.eos_token_id:
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], 1)
        assert got.row(row) == expected
        assert got.stopped[row] == (expected[-1] == tok.eos_token_id)


def test_a_sampled_completion_depends_on_its_key_not_on_its_batch(tiny_model: Path) -> None:
    """Counter-based noise: the same prompt, key and seed give the same completion in any batch (an
    out-of-memory halving or another GPU count samples the same step); another key or seed, another."""
    model, tok = _model(tiny_model)
    prompts = _prompts(tok, ["s-t-o-n-e", "a-b-c-d-e", "q-u-i-c-k"]) * 4
    sampler = GroupSampler(model, torch.device("cpu"), tok.pad_token_id, [tok.eos_token_id], torch.float32)
    whole = sampler.sample(prompts, list(range(12)), seed=5, max_new=12, temperature=1.0)
    part = sampler.sample(prompts[7:9], [7, 8], seed=5, max_new=12, temperature=1.0)
    assert [whole.row(7), whole.row(8)] == [part.row(0), part.row(1)]
    rows = {tuple(whole.row(r)) for r in range(0, 12, 3)}  # one prompt, four keys
    assert len(rows) > 1
    other = sampler.sample(prompts, list(range(12)), seed=6, max_new=12, temperature=1.0)
    assert [other.row(r) for r in range(12)] != [whole.row(r) for r in range(12)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("nf4", [False, True], ids=["bf16", "nf4"])
def test_the_decode_step_replayed_as_a_cuda_graph_samples_what_eager_steps_do(tiny_model: Path, nf4: bool) -> None:
    """On a GPU the decode step is captured once and replayed: the completions are those of the eager
    step, greedy and sampled, with a LoRA (peft) on the bf16 or the NF4 base, and no capture failed."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    kwargs: dict = {"dtype": torch.bfloat16}
    if nf4:
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, **kwargs)
    model = get_peft_model(model if nf4 else model.cuda(), LoraConfig(r=8, target_modules="all-linear"))
    prompts = _prompts(tok, ["s-t-o-n-e", "a-b", "q-u-i-c-k-l-y"]) * 2
    device = torch.device("cuda")
    runs = {}
    for graphs in (False, True):
        sampler = GroupSampler(model, device, tok.pad_token_id, [tok.eos_token_id], torch.bfloat16, graphs=graphs)
        runs[graphs] = [sampler.sample(prompts, list(range(6)), seed=3, max_new=24, temperature=t) for t in (0.0, 1.0)]
        assert sampler.graphs_failed == ""
    for eager, graphed in zip(runs[False], runs[True], strict=True):
        assert [eager.row(r) for r in range(6)] == [graphed.row(r) for r in range(6)]
        assert eager.lengths == graphed.lengths


def test_the_prefill_computes_the_last_position_s_logits_only(tiny_model: Path) -> None:
    """The prompts' pass asks the model for the logits of the last position alone (its others would
    be rows x prompt x vocabulary, 0.5 GB for 8 prompts of 128 tokens with Llama 3's vocabulary), as
    does every decode step."""
    model, tok = _model(tiny_model)
    seen: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    prompts = _prompts(tok, ["s-t-o-n-e", "a-b", "q-u-i-c-k-l-y"])
    sampler = GroupSampler(model, torch.device("cpu"), tok.pad_token_id, [tok.eos_token_id], torch.float32)
    sampler.sample(prompts, [0, 1, 2], seed=0, max_new=6, temperature=1.0)
    assert len(seen) == 6 and all(shape[:2] == (3, 1) for shape in seen)


def _kv_cache_watch(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every key and value tensor a sampling's SlotCache allocates."""
    refs: list[weakref.ref] = []
    update = SlotCache.update

    def watched(self, *args, **kwargs):
        fresh = len(self.keys)
        out = update(self, *args, **kwargs)
        if len(self.keys) > fresh:
            layer = next(reversed(self.keys))
            refs.extend([weakref.ref(self.keys[layer]), weakref.ref(self.values[layer])])
        return out

    monkeypatch.setattr(SlotCache, "update", watched)
    return refs


def test_the_kv_cache_is_freed_when_sampling_returns(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing keeps the sampling's KV cache once the completions are back (no reference cycle
    either: the cyclic collector is not needed), so the scored pass can use its memory."""
    model, tok = _model(tiny_model)
    refs = _kv_cache_watch(monkeypatch)
    sampler = GroupSampler(model, torch.device("cpu"), tok.pad_token_id, [tok.eos_token_id], torch.float32)
    gc.disable()
    try:
        sampled = sampler.sample(_prompts(tok, ["s-t-o-n-e", "a-b"]), [0, 1], seed=0, max_new=6, temperature=1.0)
        assert len(refs) == 2 * model.config.num_hidden_layers
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()
    assert sampled.tokens.shape[0] == 2


def test_a_captured_sampling_gives_its_memory_back_before_returning(tiny_model: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """After a sampling whose decode step ran as a CUDA graph, the sampler waits for the GPU, lets go
    of cuBLAS's workspaces and empties the caching allocator: the graph's private pool (which no
    other allocation can use) and the KV cache's pages go back before the scored pass. The graph
    and the cache are dead by then. A sampling that captured nothing gives nothing back. (The
    capture and the CUDA calls are stand-ins here: this runs on the CPU.)"""
    model, tok = _model(tiny_model)
    refs = _kv_cache_watch(monkeypatch)
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache",
                        lambda: calls.append("empty_cache" if all(r() is None for r in refs) else "cache alive"))
    sampler = GroupSampler(model, torch.device("cpu"), tok.pad_token_id, [tok.eos_token_id], torch.float32)
    sampler.graphs = True

    def captured(step):
        step()  # the warm-up
        sampler._captured_pool = True
        return step

    monkeypatch.setattr(sampler, "_captured", captured)
    prompts = _prompts(tok, ["s-t-o-n-e", "a-b"])
    sampler.sample(prompts, [0, 1], seed=0, max_new=6, temperature=1.0)
    assert calls == ["synchronize", "workspaces", "empty_cache"]
    calls.clear()
    sampler.graphs = False
    sampler.sample(prompts, [0, 1], seed=0, max_new=6, temperature=1.0)
    assert calls == []


def test_the_noise_samples_the_softmax_at_the_temperature() -> None:
    """Gumbel-max with the hashed noise: over many keys each token comes up as often as its
    probability at the temperature says (within sampling error)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    keys = torch.arange(20000, dtype=torch.int64)
    hashes = vocab_hashes(5, torch.device("cpu"))
    for temperature in (1.0, 0.5):
        picks = choose(logits, temperature, torch.tensor(123), keys, torch.tensor([3]), hashes)
        seen = torch.bincount(picks, minlength=5).float() / len(picks)
        expected = torch.softmax(logits[0] / temperature, -1)
        assert torch.allclose(seen, expected, atol=0.012), (temperature, seen, expected)
    assert bool((choose(logits, 0.0, torch.tensor(1), keys, torch.tensor([0]), hashes) == 0).all())


def test_token_logps_and_their_gradient_match_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    from studio.engine import token_logps as module

    monkeypatch.setattr(module, "SLICE_ELEMENTS", 40)  # several slices of 4 rows
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5, dtype=torch.float64)
    ours = token_logps(logits, targets)
    (ours.double() * weights).sum().backward()
    ours_grad = logits.grad.clone()
    logits.grad = None
    theirs = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    (theirs * weights).sum().backward()
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_grad, logits.grad, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------ the loss


def test_grpo_and_dr_grpo_normalise_as_their_papers_say(tiny_model: Path, tmp_path: Path) -> None:
    """With one update per sampling the token ratio is 1, so a step's loss value is ``-sum A x w``:
    ``grpo`` weighs each completion by 1 (its tokens by 1 / length), and the advantages of a group
    sum to 0, so its loss is 0; ``dr_grpo`` weighs every token alike (no length bias), so its loss is
    ``-sum(A x length) / (completions x max_completion_length)``. With ``beta`` > 0 the KL to the
    base is 0 while the LoRA is fresh and the reference pass switches the adapters off."""
    from studio.engine.session import Session

    for loss in ("grpo", "dr_grpo"):
        config = _config(tiny_model, tmp_path / loss)
        config.grpo.loss, config.grpo.beta = loss, 0.04
        session = Session(config, create_run(config), lambda e: None)
        session.load()
        grpo = session.grpo
        grpo.load_rewards()
        grpo.start_step(0)
        stream_batch = _first_batch(session)
        value = grpo.forward(stream_batch)[0].detach()
        group = grpo._group
        assert group is not None and len(group.completions) == 8
        advantages = [c["advantage"] for c in group.completions]
        assert abs(sum(advantages)) < 1e-3 and any(abs(a) > 0.5 for a in advantages)
        sums = grpo.sums()
        assert sums.kl_tokens > 0 and abs(sums.kl) < 1e-6  # policy == reference at the start
        if loss == "grpo":
            assert float(value) == pytest.approx(0.0, abs=1e-4)
        else:
            assert stream_batch.label_tokens == 8 * 8 * 16
            assert float(value) != pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():  # a trained-looking LoRA: the policy is no longer the base
        for name, param in session.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    grpo.start_step(1)
    grpo.forward(_first_batch(session))
    assert grpo.sums().kl / grpo.sums().kl_tokens > 1e-4


def test_the_scored_pass_takes_the_model_s_log_probs_without_its_logits(tiny_model: Path, tmp_path: Path) -> None:
    """The scored pass runs the decoder and the output head a chunk of tokens at a time: the output
    head's module never runs (no completions x vocabulary logits, nor their gradient), and each
    completion token's log-prob and every LoRA gradient are those of the plain computation from the
    model's logits (a log-softmax of every position); padding after a completion gets 0."""
    from studio.engine.session import Session

    session = Session(_config(tiny_model, tmp_path / "run"), create_run(_config(tiny_model, tmp_path / "run")),
                      lambda e: None)
    session.load()
    grpo, model = session.grpo, session.model
    assert grpo._head is not None
    with torch.no_grad():  # a trained-looking LoRA: every adapter's gradient is non-zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    batch = _first_batch(session)
    prompts = [e.input_ids for e in batch.examples for _ in range(3)]
    sampled = grpo.sampler.sample(prompts, list(range(len(prompts))), 7, 16, 1.0)
    assert len(set(sampled.lengths)) > 1  # completions of several lengths: padding after the shorter
    ids, attention, positions, answer = grpo._rows(prompts, sampled)
    weights = torch.randn(answer.shape, generator=torch.Generator().manual_seed(0))
    model.train()

    def run(chunked: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if chunked:
            logps = grpo._completion_logps(ids, attention, positions, answer)
        else:
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
            length = answer.shape[1]
            logps = logits[:, -(length + 1):-1].log_softmax(-1).gather(-1, ids[:, -length:, None])[..., 0]
            logps = logps * answer
        (logps * weights).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    head_ran: list[bool] = []
    hook = model.get_base_model().lm_head.register_forward_hook(lambda *args: head_ran.append(True))
    got, got_grads = run(chunked=True)
    assert not head_ran
    hook.remove()
    expected, expected_grads = run(chunked=False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bool((got[~answer.bool()] == 0).all())
    assert got_grads.keys() == expected_grads.keys() and len(got_grads) > 0
    for name, grad in expected_grads.items():
        assert grad.abs().sum() > 0, name
        rel = (got_grads[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo"])
def test_the_scored_pass_in_chunks_gives_the_whole_pass_s_loss_and_gradients(tiny_model: Path, tmp_path: Path,
                                                                           loss: str) -> None:
    """The scored pass taken a few completions at a time (each chunk's backward before the next
    one's forward) gives the micro-batch's loss, KL and every LoRA gradient of the pass over all of
    them at once: prompts of several lengths (left padding), completions of several lengths (right
    padding), uneven chunks, each chunk's loss over the step's one divisor."""
    from studio.engine.session import Session

    config = _config(tiny_model, tmp_path / "run")
    config.grpo.loss, config.grpo.beta = loss, (0.04 if loss == "dr_grpo" else 0.0)
    session = Session(config, create_run(config), lambda e: None)
    session.load()
    grpo, model = session.grpo, session.model
    with torch.no_grad():  # a trained-looking LoRA: every gradient (and the KL) is non-zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    examples = _first_batch(session).examples
    cut = [list(e.input_ids)[start:] for e, start in zip(examples, (0, 3, 1), strict=False)]  # 3 lengths
    prompts = [p for p in cut for _ in range(4)]
    sampled = grpo.sampler.sample(prompts, list(range(len(prompts))), 3, 16, 2.0)  # hot: lengths differ
    assert len(set(sampled.lengths)) > 1
    advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(1))
    grpo.loss_divisor = 37.0  # the step's, not the micro-batch's: every chunk is divided by it
    rows_seen: list[int] = []
    hook = grpo._head.backbone.register_forward_pre_hook(
        lambda module, args, kwargs: rows_seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    model.train()

    def run(per: int) -> tuple[torch.Tensor, tuple[float, int] | None, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        rows_seen.clear()
        grpo.scored_rows = lambda rows: per
        value, kl = grpo._scored_pass(prompts, sampled, advantages)
        (value / grpo.loss_divisor).backward()  # what the Trainer does with the loss it is handed
        return value.detach(), kl, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_kl, whole_grads = run(len(prompts))
    assert max(rows_seen) == len(prompts)
    assert len(whole_grads) > 0 and all(g.abs().sum() > 0 for g in whole_grads.values())
    for per in (5, 1):
        value, kl, grads = run(per)
        assert max(rows_seen) == per  # the policy's (and the reference's) passes held at most a chunk
        torch.testing.assert_close(value, whole, rtol=1e-5, atol=1e-6)
        if whole_kl is not None:
            assert kl is not None and kl[1] == whole_kl[1] and whole_kl[0] > 0
            assert kl[0] == pytest.approx(whole_kl[0], rel=1e-4)
        assert grads.keys() == whole_grads.keys()
        for name, grad in whole_grads.items():
            rel = (grads[name] - grad).norm() / grad.norm()
            assert rel < 1e-4, f"{per} a chunk, {name}: relative gradient error {rel:.2e}"
    hook.remove()


def test_a_step_with_its_scored_pass_in_chunks_trains_what_one_pass_does(tiny_model: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the Trainer (two steps of dr_grpo, two micro-batches each): the scored pass taken 3
    completions at a time logs the same losses and leaves the same adapters as one pass over each
    micro-batch: the Trainer hands the step's divisor to the chunks it does not backpropagate itself."""
    from studio.engine.grpo import GrpoObjective
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    config = _config(tiny_model, tmp_path / "runs", steps=2)
    config.trainer.micro_batch_size, config.trainer.effective_batch_size = 2, 4
    config.grpo.num_generations, config.grpo.loss = 4, "dr_grpo"

    def train(per: int | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        if per is not None:
            monkeypatch.setattr(GrpoObjective, "scored_rows", lambda self, rows: per)
        events: list[ev.Event] = []
        session = Session(config, create_run(config), events.append)
        session.load()
        start = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
        Trainer(session).train()
        losses = [e.loss for e in events if isinstance(e, ev.StepLogged)]
        return losses, {n: p.detach() - start[n] for n, p in session.model.named_parameters() if p.requires_grad}

    whole_losses, whole = train(None)  # each parameter's change over the two steps
    losses, chunked = train(3)
    assert len(whole_losses) == 2 and whole_losses[0] != pytest.approx(0.0, abs=1e-6)
    assert losses == pytest.approx(whole_losses, rel=1e-4, abs=1e-6)
    for name, change in whole.items():  # AdamW's updates: an element whose gradient is ~0 may flip
        assert change.norm() > 0, name
        assert (chunked[name] - change).norm() / change.norm() < 1e-3, name


def _first_batch(session):
    from studio.engine.batching import Cursor
    from studio.engine.grpo_prompts import PromptStream

    stream = PromptStream(session.data.train, 0, 64, session.grpo.per_prompt)
    units, _ = stream.take(Cursor(), 8)
    return stream.collate(units, session.tokenizer.pad_token_id)


# ------------------------------------------------------------------------------------ learning


@pytest.mark.slow
def test_the_tiny_model_learns_to_copy_words_from_rewards_alone(tiny_model: Path, tmp_path: Path,
                                                                 studio_env: dict) -> None:
    """40 steps of 8 prompts x 8 completions: the mean exact-match reward of the sampled completions
    goes from at most 0.2 to at least 0.8, and the greedy answers to held-out prompts from 0.2 to 0.8;
    `studio eval` shows each reward's mean over held-out prompts, base -> fine-tuned, and the
    prompts with both answers and their rewards."""
    from studio.engine.session import Session

    config = _config(tiny_model, tmp_path / "runs")
    config.trainer.eval_interval = 40
    events: list[ev.Event] = []
    run = create_run(config)
    Session(config, run, events.append).train()
    steps = [e for e in events if isinstance(e, ev.GrpoStepLogged) and e.split == "train"]
    assert [e.step for e in steps] == list(range(1, 41))
    exact = [e.rewards["exact_match"] for e in steps]
    assert exact[0] <= 0.2, exact
    assert sum(exact[-5:]) / 5 >= 0.8, exact
    assert steps[-1].rewards["letters_right"] > steps[0].rewards["letters_right"]
    held_out = [e for e in events if isinstance(e, ev.GrpoStepLogged) and e.split == "validation"]
    assert [e.step for e in held_out] == [0, 40]
    assert held_out[0].rewards["exact_match"] <= 0.2 and held_out[-1].rewards["exact_match"] >= 0.8
    groups = [e for e in events if isinstance(e, ev.GrpoGroupSampled)]
    assert len(groups) == 40 and set(groups[-1].completions[0]["scores"]) == {"exact_match", "letters_right"}

    done = run_studio("eval", run.id, "--runs-dir", str(tmp_path / "runs"), "--rows", "12", cwd=tmp_path, env=studio_env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["#", "prompt", "base", "reward", "fine-tuned", "reward"] and len(lines) >= 12
    assert lines[1].split()[1] == report_row_input(run)  # the part of the prompt that differs
    assert "12 test prompts, mean reward base -> fine-tuned:" in done.stdout
    report = json.loads((run.path / "eval.json").read_text())
    base, tuned = report["rewards"]["base"], report["rewards"]["fine_tuned"]
    assert set(base) == {"exact_match", "letters_right", "total"}
    assert base["exact_match"] <= 0.2 and tuned["exact_match"] >= 0.8 and tuned["total"] > base["total"]
    first = report["results"][0]
    assert first["tuned_rewards"]["total"] == pytest.approx(
        first["tuned_rewards"]["exact_match"] + first["tuned_rewards"]["letters_right"])
    assert first["prompt"].startswith("### Instruction:\nRepeat the letters of the word.")


# ------------------------------------------------------------------------------------ resilience


def report_row_input(run: RunDir) -> str:
    """The input of the first held-out row `studio eval` scored."""
    return json.loads((run.path / "eval.json").read_text())["results"][0]["fields"]["input"]


def _run_metrics(events: list[ev.Event]) -> dict[int, tuple[float, float, float]]:
    steps = {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}
    grpo = {e.step: e for e in events if isinstance(e, ev.GrpoStepLogged) and e.split == "train"}
    return {s: (steps[s], grpo[s].reward, grpo[s].completion_length) for s in steps}


def test_oom_halving_and_exact_resume_keep_a_grpo_run_the_same(tiny_model: Path, tmp_path: Path) -> None:
    """Out of memory while sampling step 2 halves the micro-batch (the sampling batch) and redoes the
    step; stopped after step 3 and resumed from its checkpoint, the run logs the uninterrupted run's
    rewards, lengths and losses at every step (the sampler's seed is in the checkpoint)."""
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    config = _config(tiny_model, tmp_path / "runs", steps=5)
    t = config.trainer
    t.micro_batch_size, t.effective_batch_size, t.checkpoint_interval, t.seed = 4, 4, 3, 7
    config.grpo.num_generations = 4

    def train(run, resume=False, oom_at=None, stop_after=None) -> list[ev.Event]:
        events: list[ev.Event] = []
        stop = (lambda trainer: "stop" if trainer.step == stop_after else None) if stop_after else None
        session = Session(config, run, events.append)
        trainer = Trainer(session, stop)
        if oom_at:
            session.load()
            sample, armed = session.grpo.sampler.sample, [True]

            def failing(*args, **kwargs):
                if armed[0] and trainer.step + 1 == oom_at and torch.is_grad_enabled():
                    armed[0] = False
                    raise torch.cuda.OutOfMemoryError("simulated out of memory while sampling")
                return sample(*args, **kwargs)

            session.grpo.sampler.sample = failing
        trainer.train(resume=resume)
        return events

    reference = _run_metrics(train(create_run(config)))
    run = create_run(config)
    first = train(run, oom_at=2, stop_after=3)
    assert [(e.old_micro_batch_size, e.micro_batch_size) for e in first if isinstance(e, ev.BatchSizeReduced)] \
        == [(4, 2)]
    state = json.loads((run.checkpoints_dir / "step-3" / "trainer_state.json").read_text())
    assert state["grpo_sampler"] == {"seed": 7}
    got = {**_run_metrics(first), **_run_metrics(train(run, resume=True))}
    assert list(got) == [1, 2, 3, 4, 5]
    for step, (loss, reward, length) in reference.items():
        assert got[step] == (pytest.approx(loss, rel=1e-3, abs=1e-5), pytest.approx(reward, abs=1e-6),
                             pytest.approx(length, abs=1e-6)), step
    assert len({r for _, r, _ in reference.values()}) > 1  # the steps differ: the comparison means something


def test_a_failing_reward_stops_the_run_in_one_line_and_it_resumes_after_the_fix(
        tiny_model: Path, tmp_path: Path, studio_env: dict) -> None:
    """`studio train` (the real worker, foreground) prints one line a step with the rewards; a reward
    that raises in step 3 ends the run with one line naming the function, the prompt and the error,
    with the run saved at step 2; after the fix `studio train --resume` finishes it from there."""
    shutil.copy(SAMPLE / "rewards.py", tmp_path / "rewards.py")
    (tmp_path / "picky.py").write_text(
        "import pathlib\n"
        "groups = 0\n"
        "def picky(completions, **kwargs):\n"
        "    global groups\n"
        "    groups += len(completions) == 4  # a training group (the check's row has 2, evaluation 1)\n"
        "    if groups > 2 and pathlib.Path(__file__).with_name('broken').exists():\n"
        "        raise KeyError('answer_column')\n"
        "    return [0.0 for _ in completions]\n")
    (tmp_path / "broken").touch()
    config = _config(tiny_model, tmp_path / "runs", steps=4)
    t = config.trainer
    t.micro_batch_size, t.effective_batch_size = 2, 2
    config.grpo.num_generations = 4
    config.grpo.rewards = [RewardConfig(name="exact_match", column="word"), RewardConfig(name="rewards.py:letters_right"),
                           RewardConfig(name="picky.py:picky", weight=0.0)]
    config.save(tmp_path / "grpo.yaml")

    def studio(*args: str) -> subprocess.CompletedProcess:
        return run_studio(*args, cwd=tmp_path, env=studio_env, timeout=300)

    # step 1 scores two groups; step 2's first group fails
    done = studio("train", str(tmp_path / "grpo.yaml"))
    assert done.returncode != 0
    step_lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 1 and "reward " in step_lines[0] and "(exact_match " in step_lines[0] \
        and "length " in step_lines[0] and "spread " in step_lines[0], done.stdout
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error (reward)")]
    assert len(errors) == 1, done.stdout + done.stderr
    assert ("reward picky (" in errors[0] and "raised KeyError: 'answer_column' on the prompt '### Instruction:"
            in errors[0] and "the run is saved at step 1" in errors[0] and "--resume" in errors[0])
    run = RunDir(next(p for p in (tmp_path / "runs").iterdir() if p.is_dir()))
    assert [p.name for p in run.checkpoints()] == ["step-1"]

    (tmp_path / "broken").unlink()  # the fix
    done = studio("train", "--resume", run.id, "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [e.step for e in iter_events(run.events_path) if isinstance(e, ev.GrpoStepLogged) and e.split == "train"]
    assert steps == [1, 2, 3, 4]
    assert (run.path / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_two_processes_sample_and_train_what_one_does(tiny_model: Path, tmp_path: Path, studio_env: dict,
                                                      ) -> None:
    """`studio train --gpus 2` on two CPU processes: each samples and scores its share of the step's
    prompts, and the run logs the rewards and losses of one process with the same prompts a step."""
    from studio.engine.session import Session

    config = _config(tiny_model, tmp_path / "runs", steps=4)
    t = config.trainer
    t.micro_batch_size, t.effective_batch_size = 2, 2
    config.grpo.num_generations = 4
    config.save(tmp_path / "two.yaml")
    env = dict(studio_env, STUDIO_DISTRIBUTED_CPU="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               STUDIO_LOCK_DIR=str(tmp_path / "locks"))
    done = run_studio("train", str(tmp_path / "two.yaml"), "--gpus", "2", cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    run = RunDir(next(p for p in (tmp_path / "runs").iterdir() if p.is_dir()))
    two = _run_metrics(list(iter_events(run.events_path)))

    config.trainer.effective_batch_size = 4  # one process: the same four prompts a step
    events: list[ev.Event] = []
    with engine_on_cpu():
        Session(config, create_run(config), events.append).train()
    one = _run_metrics(events)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        loss, reward, length = one[step]
        assert two[step] == (pytest.approx(loss, rel=1e-3, abs=1e-5), pytest.approx(reward, abs=1e-6),
                             pytest.approx(length, abs=1e-6)), step
    assert not math.isnan(one[4][0])
