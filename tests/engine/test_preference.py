"""Preference tuning (DPO, ORPO): the data shapes, lint, the pair loss, and a toy preference
learned through the real worker on the tiny model."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import REPO
from helpers.cli import run_studio

from studio.cli import main as studio_main
from studio.core import events as ev
from studio.core.config import ConfigError, RunConfig, parse_config
from studio.core.data.pairs import difference, flatten_pair, lint_pairs
from studio.core.runs import RunDir, iter_events
from studio.engine.tiny import TINY_TEMPLATE

pytestmark = pytest.mark.usefixtures("on_cpu")  # thresholds calibrated in fp32 (conftest.on_cpu)

SAMPLE = REPO / "sample_data" / "make_preference_data.py"


def _sample_module():
    spec = importlib.util.spec_from_file_location("make_preference_data", SAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pair_config(tiny_model: Path, data: Path, out: Path, method: str = "dpo") -> RunConfig:
    config = RunConfig()
    config.model.base_model = str(tiny_model)
    config.quantization.bits = None
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    config.prompt.template = TINY_TEMPLATE.replace("{output}", "{chosen}")
    config.prompt.response_field = "chosen"
    config.data.path = str(data)
    config.data.max_seq_length = 64
    t = config.trainer
    t.method, t.beta = method, 0.03
    t.learning_rate, t.max_steps, t.warmup_fraction = 3e-3, 80, 0.05
    t.micro_batch_size, t.effective_batch_size = 8, 8
    t.gradient_checkpointing, t.packing = False, False
    t.eval_interval, t.checkpoint_interval, t.log_interval = 40, 40, 10
    t.eval_max_rows = 40
    config.generation.max_new_tokens = 12
    config.output_dir = str(out)
    return config


# ------------------------------------------------------------------------------------ plain data


def test_chat_shaped_pairs_flatten_to_a_transcript_and_final_turns() -> None:
    user = {"role": "user", "content": "Capitals?"}
    separate = {"prompt": [{"role": "system", "content": "Be brief."}, user],
                "chosen": [{"role": "assistant", "content": "YES"}],
                "rejected": [{"role": "assistant", "content": "yes"}]}
    flat = flatten_pair(separate, "prompt", "chosen", "rejected")
    assert flat["prompt"] == "system: Be brief.\nuser: Capitals?"
    assert (flat["chosen"], flat["rejected"]) == ("YES", "yes")
    # TRL's layout: two whole conversations sharing their first turns.
    whole = {"chosen": [user, {"role": "assistant", "content": "YES"}],
             "rejected": [user, {"role": "assistant", "content": "no"}]}
    flat = flatten_pair(whole, "prompt", "chosen", "rejected")
    assert (flat["prompt"], flat["chosen"], flat["rejected"]) == ("user: Capitals?", "YES", "no")
    plain = {"prompt": "p", "chosen": "a", "rejected": "b"}
    assert flatten_pair(plain, "prompt", "chosen", "rejected") == plain


def test_lint_flags_identical_pairs_and_empty_sides() -> None:
    issues = lint_pairs(["A", "same  text\n", "", "ok", "Case"], ["b", "same text", "x", " ", "case"])
    assert [(i.kind, i.row) for i in issues] == [("identical", 1), ("empty_chosen", 2), ("empty_rejected", 3)]
    assert "row 1" in issues[0].message


def test_difference_marks_only_the_words_that_differ() -> None:
    left, right = difference("the cat sat down", "the dog sat down")
    assert [p.text for p in left if p.changed] == ["cat"]
    assert [p.text for p in right if p.changed] == ["dog"]
    assert "".join(p.text for p in left) == "the cat sat down"


def test_config_method_and_fields_are_checked() -> None:
    config = parse_config("trainer:\n  method: orpo\n  beta: 0.2\nprompt:\n  response_field: chosen\n")
    assert (config.trainer.method, config.trainer.beta, config.prompt.rejected_field) == ("orpo", 0.2, "rejected")
    with pytest.raises(ConfigError, match="trainer.method"):
        parse_config("trainer:\n  method: kto\n")
    with pytest.raises(ConfigError, match="line 4: .prompt.rejected_field"):
        parse_config("trainer:\n  method: dpo\nprompt:\n  rejected_field: output\n")


def test_chat_shaped_file_loads_as_pairs(tmp_path: Path) -> None:
    from studio.core.data import load_splits

    sample = _sample_module()
    rows = [sample.as_chat(r) for r in sample.case_pairs(20)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RunConfig()
    config.data.path = str(path)
    config.trainer.method = "dpo"
    config.prompt.template, config.prompt.response_field = "Q: {prompt}\nA: {chosen}", "chosen"
    splits = load_splits(config)
    first = splits.test[0]
    assert first["prompt"].startswith("user: Write the word in capitals.\n")
    assert first["chosen"].isupper() and first["rejected"] == first["chosen"].lower()


# ------------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("path", ["plain", "fast"])
def test_pair_loss_is_the_same_however_the_step_is_split(tiny_model: Path, tmp_path: Path, path: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's pairs in one micro-batch or in halves give the same loss and gradient (what exact
    resume and out-of-memory halving rely on), and DPO starts at log 2 (the policy is the reference),
    on either path (STUDIO_FAST_PATH=1 puts the fast one on the CPU)."""
    import math

    import torch

    from studio.core.runs import create_run
    from studio.engine.preference import collate_pairs
    from studio.engine.session import Session

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _sample_module().case_pairs(40)))
    config = _pair_config(tiny_model, data, tmp_path / "runs")
    monkeypatch.setenv("STUDIO_FAST_PATH", "1" if path == "fast" else "0")
    session = Session(config, create_run(config), lambda e: None)
    session.load()
    assert (session.fast is not None) == (path == "fast") and session.preference is not None
    pairs = session.data.train[:4]
    pad = session.tokenizer.pad_token_id
    params = [p for p in session.model.parameters() if p.requires_grad]
    # A fresh LoRA's B is zero: nudge it so the policy differs from the reference.
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.02)

    def step(groups: list[list]) -> tuple[float, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        total = 0.0
        for group in groups:
            loss, _ = session.preference.forward(collate_pairs(group, pad))
            (loss / len(pairs)).backward()
            total += float(loss.detach())
        return total / len(pairs), [p.grad.clone() for p in params]

    whole, grads_whole = step([pairs])
    halves, grads_halves = step([pairs[:2], pairs[2:]])
    assert whole == pytest.approx(halves, rel=1e-5)
    for a, b in zip(grads_whole, grads_halves, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert whole != pytest.approx(math.log(2), abs=1e-4)
    with torch.no_grad():
        for p in params:
            p.zero_()  # LoRA off in effect: the policy is its own reference, every pair's loss is log 2
        loss, wins = session.preference.forward(collate_pairs(pairs, pad))
    assert float(loss) / len(pairs) == pytest.approx(math.log(2), abs=1e-5)
    # Plain, the zero update leaves the base's numbers to the bit: no pair ranks chosen first. The
    # fast path's reference pass adds the residual inside the base product, the policy's after the
    # (zero) update: the margins are rounding (~1e-7), and a tie may fall either way.
    assert path == "fast" or int(wins) == 0


def test_oom_halving_and_exact_resume_keep_a_dpo_run_the_same(tiny_model: Path, tmp_path: Path) -> None:
    """A DPO run with a (simulated) out-of-memory in step 2, stopped after step 3 and resumed from
    its checkpoint, logs the uninterrupted run's losses and preference metrics at every step."""
    from helpers.oom_injection import inject_from_spec

    from studio.core.runs import create_run
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _sample_module().case_pairs(40, test_fraction=0)))
    config = _pair_config(tiny_model, data, tmp_path / "runs")
    t = config.trainer
    t.max_steps, t.micro_batch_size, t.effective_batch_size, t.log_interval = 5, 4, 4, 1
    t.eval_interval, t.checkpoint_interval = 0, 3
    t.learning_rate = 1e-2  # steps that move: a wrong batch or state would show in the next loss

    def train(run, resume=False, oom=None, stop_after=None) -> list[ev.Event]:
        events: list[ev.Event] = []
        stop = (lambda trainer: "stop" if trainer.step == stop_after else None) if stop_after else None
        trainer = Trainer(Session(config, run, events.append), stop)
        if oom:
            inject_from_spec(trainer, oom)
        trainer.train(resume=resume)
        return events

    def by_step(events: list[ev.Event]) -> dict[int, tuple[float, float]]:
        steps = {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}
        prefs = {e.step: e.reward_margin for e in events if isinstance(e, ev.PreferenceLogged)}
        return {s: (steps[s], prefs[s]) for s in steps}

    reference = by_step(train(create_run(config)))
    run = create_run(config)
    first = train(run, oom="2", stop_after=3)
    assert [(e.old_micro_batch_size, e.micro_batch_size) for e in first if isinstance(e, ev.BatchSizeReduced)] \
        == [(4, 2)]
    got = {**by_step(first), **by_step(train(run, resume=True))}
    assert list(got) == [1, 2, 3, 4, 5]
    for step, (loss, margin) in reference.items():
        assert got[step] == (pytest.approx(loss, rel=1e-4, abs=1e-6), pytest.approx(margin, rel=1e-3, abs=1e-5))


@pytest.mark.parametrize("path", ["plain", "fast"])
def test_orpo_learns_the_case_preference_without_a_reference(tiny_model: Path, tmp_path: Path, path: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """ORPO (the chosen answer's loss plus the odds-ratio term; no reference pass): the validation
    pairs' accuracy goes from a coin toss to at least 90% in 40 steps, on either path."""
    from studio.core.runs import create_run
    from studio.engine.session import Session

    monkeypatch.setenv("STUDIO_FAST_PATH", "1" if path == "fast" else "0")

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _sample_module().case_pairs(200, test_fraction=0)))
    config = _pair_config(tiny_model, data, tmp_path / "runs", method="orpo")
    config.trainer.beta, config.trainer.learning_rate, config.trainer.max_steps = 0.5, 5e-3, 40
    config.trainer.eval_interval, config.trainer.checkpoint_interval = 0, 0
    events: list[ev.Event] = []
    session = Session(config, create_run(config), events.append)
    session.load()
    assert (session.fast is not None) == (path == "fast")
    session.model.disable_adapter = None  # ORPO must not ask for the reference model
    before = session.evaluate()
    session.train()
    validation = [e for e in events if isinstance(e, ev.PreferenceLogged) and e.split == "validation"]
    assert [e.method for e in validation] == ["orpo", "orpo", "orpo"]  # step 0 (the base), then two
    assert validation[0].accuracy <= 0.7 and validation[-1].accuracy >= 0.9
    assert validation[-1].loss < before.loss


# ------------------------------------------------------------------------------------ the worker


def test_dpo_through_the_worker_learns_the_case_preference(tiny_model: Path, tmp_path: Path, studio_env: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`studio train` (the real worker) runs DPO on pairs that ask for capitals or small letters, on
    the fast path (STUDIO_FAST_PATH=1: on a GPU it is the default); `studio eval` shows the base
    preferring the chosen answer of about half the held-out pairs (it ignores the instruction) and
    the fine-tune of at least 90%."""
    monkeypatch.setenv("STUDIO_FAST_PATH", "1")  # the `studio eval` worker below inherits it too
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _sample_module().case_pairs(400)))
    config = _pair_config(tiny_model, data, tmp_path / "runs")
    config.save(tmp_path / "dpo.yaml")
    start = time.monotonic()
    done = run_studio("train", str(tmp_path / "dpo.yaml"), cwd=tmp_path, env={**studio_env, "STUDIO_FAST_PATH": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    run = RunDir(next(p for p in (tmp_path / "runs").iterdir() if p.is_dir()))
    events = list(iter_events(run.events_path))
    loaded = next(e for e in events if isinstance(e, ev.ModelLoaded))
    assert loaded.path == "fast" and "reference pass" in loaded.path_reason, loaded
    train = [e for e in events if isinstance(e, ev.PreferenceLogged) and e.split == "train"]
    assert [e.step for e in train] == list(range(10, 81, 10))
    assert train[-1].accuracy >= 0.9 and train[-1].reward_margin > train[0].reward_margin
    validation = [e for e in events if isinstance(e, ev.PreferenceLogged) and e.split == "validation"]
    # step 0: the base model's preference, before training
    assert [e.step for e in validation] == [0, 40, 80] and validation[-1].accuracy >= 0.9

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert studio_main(["eval", str(run.path), "--json", "--rows", "30"]) == 0
    finally:
        # `studio eval` started a worker that lingers for its next client, holding the device's
        # lock: later tests in this process would find the device busy.
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while run.worker_pid() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
    report = json.loads(out.getvalue())
    print(f"preference: {report['preference']}, {time.monotonic() - start:.0f} s")
    assert 0.3 <= report["preference"]["base_accuracy"] <= 0.7
    assert report["preference"]["fine_tuned_accuracy"] >= 0.9
    from studio.cli.evaluate import format_table

    table = format_table(report)
    tuned = report["preference"]["fine_tuned_accuracy"]  # 100% here, 96.7% on the GPU box's CPU
    assert f"held-out accuracy ({len(report['results'])} {report['split']} pairs), prefers the chosen answer: base " \
        in table and f" -> fine-tuned {tuned:.1%}" in table
    row = report["results"][0]
    assert row["rejected"] and row["base_margin"] is not None and row["tuned_margin"] is not None
    assert (run.path / "eval.csv").read_text().splitlines()[0].endswith("rejected,base_margin,tuned_margin")


@pytest.mark.parametrize("path", ["fast", "plain"])
def test_the_estimate_counts_two_sequences_a_pair(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A DPO micro-batch of 4 pairs needs the activations of 8 sequences; the largest micro-batch
    that fits is counted in pairs (about half the SFT one), and the note says so, on the fast path
    (the default on a GPU) and on the plain one (STUDIO_FAST_PATH=0)."""
    from studio.core.memory import estimate
    from studio.core.model.info import KNOWN_MODELS

    llama = KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]
    sft = RunConfig()
    dpo = parse_config("trainer: {method: dpo}\nprompt: {response_field: chosen}\n")
    capacity = 24 * 10**9
    if path == "plain":
        monkeypatch.setenv("STUDIO_FAST_PATH", "0")
    a, b = estimate(sft, llama, capacity), estimate(dpo, llama, capacity)
    assert a.path == b.path == path
    doubled = estimate(sft, llama, capacity, micro_batch=2 * sft.trainer.micro_batch())
    # the step's categories (an evaluation between steps can set a DPO run's peak: its reference pass)
    assert b.step_categories["activations"] == doubled.step_categories["activations"] > a.step_categories["activations"]
    assert b.max_micro_batch in (a.max_micro_batch // 2 - 1, a.max_micro_batch // 2, a.max_micro_batch // 2 + 1)
    assert any("reference pass" in note for note in b.notes)


def test_the_fast_estimate_of_dpo_shares_the_graph_s_pool_with_its_reference_pass() -> None:
    """On the fast path with CUDA graphs, DPO's reference pass is a graph of its own in the policy
    graph's private pool (engine/fast/graphs.py's ReferenceGraph): the pool holds the larger of the two
    working sets, so on Llama-2-7B (the policy's is larger) DPO reserves more than ORPO on the same
    pairs (no reference) by the pass's static output only, a fraction of its working set, which an
    eager pass beside the graph reserved on top (1% over TRL's DPO on one H200 before, bench/NOTES.md
    section 6). Without graphs (a micro-batch above their token limit) the step reuses the eager
    pass's blocks and the two reserve the same. `studio estimate` says fast for both, and that DPO's
    reference pass runs through the same layers as a CUDA graph."""
    from studio.core.memory import estimate
    from studio.core.memory.allocator import PAGE
    from studio.core.memory.fast import graph_pool_bytes, reference_graph_bytes, reference_pass_bytes
    from studio.core.model.info import KNOWN_MODELS
    from studio.core.plan import GRAPH_TOKEN_LIMIT

    llama = KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]
    dpo, orpo = (parse_config(f"trainer: {{method: {m}}}\nprompt: {{response_field: chosen}}\n") for m in ("dpo", "orpo"))
    a, b = estimate(dpo, llama), estimate(orpo, llama)
    assert a.path == b.path == "fast" and a.choice.cuda_graphs
    assert "reference pass" in a.choice.reason and "reference" not in b.choice.reason
    assert "CUDA graph in the policy's memory pool" in a.choice.reason
    tokens = a.plan.tokens
    assert reference_graph_bytes(llama, tokens, 2) < graph_pool_bytes(llama, tokens, 2, gate_in_kernel=True)
    output = tokens * llama.hidden * 2  # bf16 final hidden states
    step = "training step"  # (DPO's evaluation between steps, a reference pass beside the pool, can be its peak)
    assert abs(a.phases[step].reserved - b.phases[step].reserved - output) <= PAGE
    assert output < reference_pass_bytes(llama, tokens, 2) / 10
    big_dpo, big_orpo = (estimate(c, llama, micro_batch=8) for c in (dpo, orpo))  # 8 x 2 x 512 tokens
    assert big_dpo.plan.tokens > GRAPH_TOKEN_LIMIT
    assert big_dpo.peak_reserved == big_orpo.peak_reserved


def test_studio_estimate_on_the_dpo_sample_says_fast(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """`studio estimate` on the bundled DPO config (an 8B model, offline): the fast path, with its
    per-answer log-probs and the reference pass through the same layers, and the pair note."""
    from argparse import Namespace

    from studio.cli.estimate import main

    monkeypatch.delenv("STUDIO_FAST_PATH", raising=False)
    config = SAMPLE.parent / "preference" / "preference_config.yaml"
    assert main(Namespace(config=str(config), gpu_gb=24.0, json=False, model="meta-llama/Llama-3.1-8B")) == 0
    out = capsys.readouterr().out
    assert "path: fast (" in out and "each answer's log-prob from the fused cross-entropy" in out, out
    assert "the reference pass through the same layers with the adapters off (a CUDA graph" in out
    assert "a preference pair is two sequences" in out


def test_the_training_state_folds_preference_curves_and_words_them() -> None:
    """The training pane's state: a preference run's curves, its eval line in place of the SFT
    one, and a resume that drops the redone steps' points."""
    from studio.core.runs import report
    from studio.ui.metrics import fold

    def logged(step: int, accuracy: float, split: str = "train") -> ev.PreferenceLogged:
        return ev.PreferenceLogged(step=step, split=split, method="dpo", loss=0.5, reward_margin=step / 10,
                                   chosen_logp=-10.0, rejected_logp=-10.0 - step, accuracy=accuracy, pairs=8)

    state = fold([ev.RunStarted(total_steps=40), logged(10, 0.5), logged(20, 0.75), logged(20, 0.9, "validation"),
                  logged(30, 1.0)])
    curves = state.preference
    assert curves.active and curves.rejected_logp.values == [-20.0, -30.0, -40.0]
    assert curves.eval_accuracy.values == [0.9]
    assert state.eval_line() == report.preference_line(curves.last_eval)
    assert state.eval_line().startswith("dpo eval at step 20: loss 0.5000  validation accuracy 90.0%")
    state.apply(ev.RunStarted(total_steps=40, resumed_from_step=20))
    assert curves.accuracy.steps == [10, 20]
    assert not fold([ev.RunStarted(total_steps=4)]).preference.active
