"""The automatic plan: ``trainer.micro_batch_size: auto`` / ``gradient_checkpointing: auto``.

The planner on a Llama-2-7B shape and three cards, the config keys, ``studio estimate``'s report,
the engine's resolution (on the CPU: today's defaults; on a card: the plan, recorded for resume),
the wording of its events, the OOM halving's estimate note and the VRAM pane in the real app.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers.ui import make_config, settle, workdir

from studio.core import events as ev
from studio.core.config import AUTO, ConfigError, parse_config
from studio.core.memory import autoplan, estimate
from studio.core.memory.gpus import GB, GIB, gpu_for_size
from studio.core.model.info import from_config_dict
from studio.core.runs import create_run
from studio.core.runs.report import describe

LLAMA2_7B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": 0.02,
}
LLAMA = from_config_dict(LLAMA2_7B_CONFIG_JSON, "meta-llama/Llama-2-7b-hf")
LLAMA_YAML = "model: {base_model: meta-llama/Llama-2-7b-hf}\nlora: {dropout: 0.0}\n"


def fits(config, micro: int, ckpt: bool, capacity: int) -> bool:
    option = autoplan.with_values(config, micro, ckpt, autoplan.effective_batch(config))
    return estimate(option, LLAMA).total <= capacity - autoplan.headroom_for(capacity)


# --------------------------------------------------------------------------------------- config


def test_auto_is_the_default_and_means_todays_values_without_a_card():
    config = parse_config("")
    assert (config.trainer.micro_batch_size, config.trainer.gradient_checkpointing) == (AUTO, AUTO)
    assert (config.trainer.micro_batch(), config.trainer.checkpointing(), config.trainer.accumulation_steps()) \
        == (4, True, 4)
    resolved = autoplan.cpu_values(config).trainer
    assert (resolved.micro_batch_size, resolved.gradient_checkpointing, resolved.accumulation_steps()) == (4, True, 4)
    assert "micro_batch_size: auto" in config.to_yaml()
    assert parse_config(config.to_yaml()).trainer.micro_batch_size == AUTO


def test_auto_parses_in_any_case_and_numbers_stay_numbers():
    t = parse_config("trainer: {micro_batch_size: Auto, gradient_checkpointing: AUTO}\n").trainer
    assert (t.micro_batch_size, t.gradient_checkpointing) == (AUTO, AUTO)
    t = parse_config("trainer: {micro_batch_size: 8, gradient_checkpointing: false}\n").trainer
    assert (t.micro_batch_size, t.gradient_checkpointing, t.micro_batch(), t.checkpointing()) == (8, False, 8, False)
    assert parse_config("trainer: {micro_batch_size: '2'}\n").trainer.micro_batch_size == 2


@pytest.mark.parametrize(("yaml_text", "expected"), [
    ("trainer:\n  micro_batch_size: fast\n", r"line 2: 'trainer.micro_batch_size' must be greater than 0 \(or auto\)"),
    ("trainer:\n  micro_batch_size: 0\n", r"'trainer.micro_batch_size' must be greater than 0"),
    ("trainer:\n  gradient_checkpointing: sometimes\n",
     r"line 2: 'trainer.gradient_checkpointing' is 'sometimes'; write true, false or auto"),
])
def test_bad_values_name_the_key(yaml_text, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config(yaml_text, "x.yaml")


# -------------------------------------------------------------------------------------- planner


@pytest.mark.parametrize("gb", [16, 24, 80])
def test_plain_path_picks_the_fastest_fitting_plan_and_keeps_the_effective_batch(gb, monkeypatch):
    monkeypatch.setenv("STUDIO_FAST_PATH", "0")  # both keys vary on the plain path
    config = parse_config(LLAMA_YAML + "trainer: {effective_batch_size: 32}\n")
    capacity = gpu_for_size(gb).capacity
    plan = autoplan.plan(config, LLAMA, capacity)
    c = plan.chosen
    assert plan.path == "plain" and plan.effective_batch == 32
    assert c.micro_batch * c.accumulation == 32
    assert c.total <= capacity - plan.headroom and plan.headroom == autoplan.headroom_for(capacity)
    # the largest micro-batch that fits with the chosen checkpointing, and nothing faster fits
    fitting = [m for m in (1, 2, 4, 8, 16, 32) if fits(config, m, c.checkpointing, capacity)]
    assert c.micro_batch == max(fitting)
    assert all(r.total > plan.budget for r in plan.rejected if r.speed > c.speed)
    assert len(plan.rejected) == 2 * 6 - 1  # every divisor of 32, checkpointing on and off
    for r in plan.rejected:
        assert r.micro_batch * r.accumulation == 32
        if r.total > plan.budget:
            assert r.reason == (f"needs {r.total / GB:.1f} GB, card has {capacity / GB:.1f} GB less "
                                f"{plan.headroom / GB:.1f} GB headroom")
        else:
            assert r.reason.startswith(f"fits ({r.total / GB:.1f} GB) but slower")
    applied = plan.apply(config).trainer
    assert (applied.micro_batch_size, applied.gradient_checkpointing, applied.accumulation_steps()) == \
        (c.micro_batch, c.checkpointing, c.accumulation)


def test_bigger_cards_get_bigger_micro_batches_on_the_fast_path():
    config = parse_config(LLAMA_YAML + "trainer: {effective_batch_size: 128}\ndata: {max_seq_length: 1024}\n")
    chosen = {gb: autoplan.plan(config, LLAMA, gpu_for_size(gb).capacity).chosen for gb in (16, 24, 80)}
    sizes = [chosen[gb].micro_batch for gb in (16, 24, 80)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] == 128
    for gb, c in chosen.items():  # the largest that fits: twice as many rows would not
        if c.micro_batch < 128:
            assert not fits(config, 2 * c.micro_batch, True, gpu_for_size(gb).capacity), gb
    assert all(c.checkpointing and c.micro_batch * c.accumulation == 128 for c in chosen.values())
    plan = autoplan.plan(config, LLAMA, gpu_for_size(16).capacity)
    assert plan.path == "fast"
    assert len(plan.rejected) == 7  # the fast path checkpoints every layer: only the micro-batch varies
    faster = [m for m in (128, 64, 32, 16, 8, 4, 2, 1) if m > plan.chosen.micro_batch]
    assert [r.micro_batch for r in plan.rejected if r.speed > plan.chosen.speed] == faster
    lines = plan.lines()
    mb, acc = plan.chosen.micro_batch, plan.chosen.accumulation
    assert lines[0].startswith(f"automatic plan: micro-batch {mb} x {acc}, checkpointing (effective batch 128)")
    assert lines[1].startswith("  rejected micro-batch 128 x 1, checkpointing: needs ")
    assert lines[-1] == f"  and {7 - len(faster)} slower plans"


def test_a_key_set_explicitly_is_not_varied(monkeypatch):
    monkeypatch.setenv("STUDIO_FAST_PATH", "0")
    config = parse_config(LLAMA_YAML + "trainer: {micro_batch_size: 2, effective_batch_size: 16}\n")
    plan = autoplan.plan(config, LLAMA, gpu_for_size(80).capacity)
    assert {(c.micro_batch, c.accumulation) for c in (plan.chosen, *plan.rejected)} == {(2, 8)}
    assert plan.varied == ("gradient_checkpointing",)
    assert plan.chosen.checkpointing is False  # 80 GB holds micro-batch 2 without recompute: faster


def test_speed_proxy_prefers_big_micro_batches_and_no_recompute():
    assert autoplan.relative_speed(8192, False) > autoplan.relative_speed(4096, False)
    assert autoplan.relative_speed(4096, True) == pytest.approx(autoplan.relative_speed(4096, False) * 3 / 4)
    assert autoplan.headroom_for(80 * GIB) == 8 * GIB
    assert autoplan.headroom_for(4 * GIB) == 1 * GIB


def test_nothing_fits_names_the_keys_to_change():
    """The keys whose memory could win back a real part of the gap, largest first, each with the GB
    it acts on; not those that act on less than a tenth of it (LoRA r16's adapters, gradients and
    optimizer state against a 15.7 GB gap)."""
    config = parse_config(LLAMA_YAML + "data: {max_seq_length: 4096}\nquantization: {bits: 8}\n")
    with pytest.raises(autoplan.AutoPlanError) as err:
        autoplan.plan(config, LLAMA, gpu_for_size(16).capacity)
    message = str(err.value)
    assert message.startswith("no plan fits 16.1 GB less 1.6 GB headroom: the smallest, micro-batch 1 x 16")
    advice = message.split("GB; ", 1)[1]
    assert advice.index("data.max_seq_length (now 4096; activations") < advice.index("quantization.bits: 4 (weights")
    assert advice.endswith("a smaller model")
    for needless in ("lora.r", "trainer.optimizer"):
        assert needless not in message, message
    assert err.value.rejected and all(r.reason.startswith("needs ") for r in err.value.rejected)
    planned = autoplan.plan_or_smallest(config, LLAMA, gpu_for_size(16).capacity)
    smallest = planned.config.trainer
    assert planned.plan is None and str(planned.refused) == message
    assert (smallest.micro_batch_size, smallest.gradient_checkpointing) == (1, True)
    assert planned.smallest is not None and planned.smallest.micro_batch == 1
    assert planned.lines() == [f"automatic plan: {message}"]


def test_nothing_fits_gives_only_the_advice_that_changes_something():
    """Already 4-bit, a paged optimizer and micro-batch 1 set: the message does not tell the person to
    do what the config already does (it once said "use quantization.bits: 4" to a 4-bit run)."""
    config = parse_config(LLAMA_YAML + "data: {max_seq_length: 16384}\nquantization: {bits: 4}\n"
                          "trainer: {micro_batch_size: 1, optimizer: paged_adamw_8bit}\n")
    with pytest.raises(autoplan.AutoPlanError) as err:
        autoplan.plan(config, LLAMA, gpu_for_size(8).capacity)
    message = str(err.value)
    assert "data.max_seq_length (now 16384;" in message and "lora.r (adapters, gradients and optimizer state" in message
    for needless in ("quantization.bits", "trainer.optimizer", "to auto"):
        assert needless not in message, message


# ----------------------------------------------------------------------------- studio estimate


def _estimate_cli(tmp_path, text: str, *args: str, capsys) -> str:
    from studio.cli import estimate as cli_estimate

    path = tmp_path / "c.yaml"
    path.write_text(text)
    parser_args = type("Args", (), {"config": str(path), "gpu_gb": 16.0, "json": "--json" in args, "model": None})
    assert cli_estimate.main(parser_args()) == 0
    return capsys.readouterr().out


def test_estimate_json_and_text_show_the_plan(tmp_path, capsys):
    data = json.loads(_estimate_cli(tmp_path, LLAMA_YAML + "trainer: {effective_batch_size: 64}\n", "--json",
                                    capsys=capsys))
    auto = data["auto_plan"]
    assert set(auto) >= {"chosen", "rejected", "capacity", "headroom", "budget", "effective_batch_size", "path"}
    chosen = auto["chosen"]
    assert data["plan"]["micro_batch"] == chosen["micro_batch_size"]  # the estimate is of the chosen plan
    assert data["total"] == chosen["total"] <= auto["budget"]
    assert chosen["micro_batch_size"] * chosen["gradient_accumulation_steps"] == 64
    assert all(r["reason"] for r in auto["rejected"])
    text = _estimate_cli(tmp_path, LLAMA_YAML + "trainer: {effective_batch_size: 64}\n", capsys=capsys)
    assert f"automatic plan: micro-batch {chosen['micro_batch_size']} x " in text
    big = json.loads(_estimate_cli(tmp_path, LLAMA_YAML + "trainer: {effective_batch_size: 512}\n", "--json",
                                   capsys=capsys))["auto_plan"]
    too_big = [r for r in big["rejected"] if r["total"] > big["budget"]]
    assert too_big and too_big[0]["micro_batch_size"] > big["chosen"]["micro_batch_size"]
    text = _estimate_cli(tmp_path, LLAMA_YAML + "trainer: {effective_batch_size: 512}\n", capsys=capsys)
    assert f"  rejected micro-batch {too_big[0]['micro_batch_size']} x " in text and ": needs " in text
    explicit = json.loads(_estimate_cli(tmp_path, LLAMA_YAML + "trainer: {micro_batch_size: 4, "
                                        "gradient_checkpointing: true}\n", "--json", capsys=capsys))
    assert explicit["auto_plan"] is None and explicit["plan"]["micro_batch"] == 4


def test_estimate_json_when_nothing_fits(tmp_path, capsys):
    data = json.loads(_estimate_cli(tmp_path, LLAMA_YAML + "data: {max_seq_length: 4096}\nquantization: {bits: 8}\n",
                                    "--json", capsys=capsys))
    assert data["auto_plan"]["error"].startswith("no plan fits")
    assert data["plan"]["micro_batch"] == 1 and data["fits"] is False


# ---------------------------------------------------------------------------- engine resolution


def test_engine_resolves_on_a_card_records_the_plan_and_reuses_it(tmp_path, monkeypatch):
    from studio.engine import planning

    config = parse_config(LLAMA_YAML + "trainer: {effective_batch_size: 128}\ndata: {max_seq_length: 1024}\n")
    config.output_dir = str(tmp_path / "runs")
    run = create_run(config)
    monkeypatch.setattr(planning, "card_capacity", lambda device: gpu_for_size(24).capacity)
    events: list[ev.Event] = []
    expected = autoplan.plan(config, LLAMA, gpu_for_size(24).capacity).chosen  # the planner's own choice
    mb, acc = expected.micro_batch, expected.accumulation
    assert mb < 128  # the card does not hold the whole effective batch at once
    resolved, plan = planning.resolve(config, run, torch.device("cuda"), events.append)
    assert plan is not None and (resolved.trainer.micro_batch_size, resolved.trainer.accumulation_steps()) == (mb, acc)
    [chosen] = events
    assert isinstance(chosen, ev.AutoPlanChosen) and not chosen.recorded
    assert (chosen.micro_batch_size, chosen.gradient_accumulation_steps, chosen.effective_batch_size) == (mb, acc, 128)
    assert chosen.rejected[0].startswith("micro-batch 128 x 1, checkpointing: needs ")
    assert json.loads((run.path / autoplan.PLAN_FILE).read_text())["micro_batch_size"] == mb
    # resumed on a fuller card: the run's own values, not a new plan
    monkeypatch.setattr(planning, "card_capacity", lambda device: gpu_for_size(16).capacity)
    events.clear()
    again, plan = planning.resolve(config, run, torch.device("cuda"), events.append)
    assert plan is None and again.trainer.micro_batch_size == mb and events[0].recorded


def test_engine_refuses_a_run_that_cannot_fit_the_card(tmp_path, monkeypatch):
    from studio.engine import planning

    config = parse_config(LLAMA_YAML + "data: {max_seq_length: 4096}\nquantization: {bits: 8}\n")
    config.output_dir = str(tmp_path / "runs")
    monkeypatch.setattr(planning, "card_capacity", lambda device: gpu_for_size(16).capacity)
    with pytest.raises(planning.PlanRefused, match="data.max_seq_length"):
        planning.resolve(config, create_run(config), torch.device("cuda"), [].append)


def test_engine_trains_the_smallest_plan_the_estimate_shows_when_only_the_headroom_is_short(tmp_path, monkeypatch):
    from studio.engine import planning

    config = parse_config(LLAMA_YAML + "data: {max_seq_length: 4096}\nquantization: {bits: 8}\n")
    config.output_dir = str(tmp_path / "runs")
    least = autoplan.plan_or_smallest(config, LLAMA, gpu_for_size(16).capacity).smallest
    assert least is not None
    capacity = least.total + 100 * 10**6  # holds the smallest plan, not the headroom beside it
    shown = autoplan.plan_or_smallest(config, LLAMA, capacity)  # what `studio estimate` and the pane show
    monkeypatch.setattr(planning, "card_capacity", lambda device: capacity)
    events: list[ev.Event] = []
    resolved, plan = planning.resolve(config, create_run(config), torch.device("cuda"), events.append)
    assert plan is None and shown.plan is None
    t, expected = resolved.trainer, shown.config.trainer
    assert (t.micro_batch_size, t.gradient_checkpointing) == (expected.micro_batch_size, expected.gradient_checkpointing)
    assert t.micro_batch_size == least.micro_batch
    assert "trying the smallest plan" in events[0].message


def test_auto_on_the_cpu_trains_with_todays_defaults(tiny_config, on_cpu):
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    t = tiny_config.trainer
    t.micro_batch_size, t.gradient_checkpointing, t.effective_batch_size, t.max_steps = AUTO, AUTO, 8, 2
    t.eval_interval, t.checkpoint_interval = 0, 0
    run = create_run(tiny_config)
    events: list[ev.Event] = []
    finished = Trainer(Session(tiny_config, run, events.append)).train()
    assert finished.step == 2 and not finished.stopped
    started = next(e for e in events if isinstance(e, ev.RunStarted))
    assert (started.micro_batch_size, started.gradient_accumulation_steps) == (4, 2)
    assert not any(isinstance(e, ev.AutoPlanChosen) for e in events)  # no GPU planning on a CPU
    assert autoplan.recorded(run.path) == {"micro_batch_size": 4, "gradient_checkpointing": True,
                                           "effective_batch_size": 8}


def test_the_halving_event_carries_the_estimate_it_contradicts(tiny_config, monkeypatch):
    from helpers.oom_injection import inject_from_spec

    from studio.engine import oom
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    seen = []
    monkeypatch.setattr(oom, "estimate_for", lambda config, micro, device, capacity=0: (
        seen.append(micro) or (13_100_000_000, 15_000_000_000)))
    tiny_config.trainer.max_steps, tiny_config.trainer.eval_interval = 2, 0
    events: list[ev.Event] = []
    trainer = Trainer(Session(tiny_config, create_run(tiny_config), events.append))
    inject_from_spec(trainer, "1")
    trainer.train()
    [reduced] = [e for e in events if isinstance(e, ev.BatchSizeReduced)]
    assert seen == [8] and (reduced.estimated_bytes, reduced.capacity_bytes) == (13_100_000_000, 15_000_000_000)
    assert describe(reduced).endswith("; the estimate said 13.10 GB would fit in 15.00 GB: it did not, so it was "
                                      "at least 1.90 GB (15%) low")


# ------------------------------------------------------------------------------------- wording


def test_report_words_the_plan_and_the_miss():
    chosen = ev.AutoPlanChosen(micro_batch_size=8, gradient_accumulation_steps=2, gradient_checkpointing=True,
                               effective_batch_size=16, path="fast", estimated_bytes=9_250_000_000,
                               capacity_bytes=16_100_000_000, headroom_bytes=1_610_000_000,
                               rejected=["micro-batch 16 x 1, checkpointing: needs 17.2 GB, card has 16.1 GB "
                                         "less 1.6 GB headroom"])
    assert describe(chosen) == (
        "automatic plan: micro-batch 8 x 2 accumulation (effective batch 16), checkpointing, fast path: "
        "9.25 GB estimated of 16.10 GB less 1.61 GB headroom; rejected micro-batch 16 x 1, checkpointing: "
        "needs 17.2 GB, card has 16.1 GB less 1.6 GB headroom")
    assert describe(replace(chosen, recorded=True)).endswith("checkpointing, as planned at the start of this run")
    assert ev.from_json(ev.to_json(chosen)) == chosen
    over = ev.BatchSizeReduced(step=3, old_micro_batch_size=8, micro_batch_size=4, gradient_accumulation_steps=2,
                               estimated_bytes=17_000_000_000, capacity_bytes=16_000_000_000)
    assert describe(over).endswith("; the estimate said 17.00 GB, more than the card's 16.00 GB")
    assert "estimate" not in describe(replace(over, estimated_bytes=0))


# --------------------------------------------------------------------------------------- the pane


@pytest.mark.anyio
async def test_the_vram_pane_shows_the_plan_and_what_it_rejected(tmp_path, monkeypatch):
    from studio.core.memory.gpus import KNOWN_GPUS
    from studio.core.model.info import load_model_info
    from studio.ui.app import StudioApp
    from studio.ui.panes import vram as vram_pane
    from studio.ui.panes.vram import VramPane

    monkeypatch.setattr(vram_pane, "capacity_choices", lambda: list(KNOWN_GPUS))  # the same on a GPU box
    workdir(tmp_path, monkeypatch)
    config = make_config(model="meta-llama/Llama-2-7b-hf", max_len=1024)
    config.lora.dropout, config.trainer.effective_batch_size = 0.0, 128
    app = StudioApp(config, settings=False, initial_pane="vram")
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot, rounds=1)
        pane = app.query_one(VramPane)
        pane._use_card(gpu_for_size(16))
        await settle(pilot, rounds=1, panes=False)
        text = str(app.query_one("#vram-plan").render())
        plan = autoplan.plan(config, load_model_info(config.model.base_model), gpu_for_size(16).capacity)
        mb, acc = plan.chosen.micro_batch, plan.chosen.accumulation
        assert text.startswith(f"automatic plan: micro-batch {mb} x {acc}, checkpointing (effective batch 128)")
        assert f"rejected micro-batch {2 * mb} x {acc // 2}, checkpointing: needs " in text
        assert pane.current is not None and pane.current.plan.micro_batch == mb
        await pilot.press("w")  # the walkthrough's steps are not the plan: its lines go
        assert str(app.query_one("#vram-plan").render()) == ""
