"""The block gauge and the VRAM pane: scale, colours by category, walkthrough, live measurement."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from studio.core import events as ev
from studio.core.config import RunConfig, parse_config
from studio.core.memory.gpus import GB, KNOWN_GPUS, Gpu
from studio.ui.messages import MemorySample
from studio.ui.panes import vram as vram_pane
from studio.ui.panes.vram import VramPane
from studio.ui.widgets.block_gauge import BlockGauge, choose_unit, square_categories

SIZE = (110, 44)
LLAMA_CONFIG = "model: {base_model: meta-llama/Llama-2-7b-hf}\n"


class PaneApp(App):
    """The smallest host for the pane: an app with a ``config`` attribute, like StudioApp."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config
        self.current_run = None  # no run followed: samples come for run None

    def compose(self) -> ComposeResult:
        yield VramPane(id="pane-vram")


async def estimated(app: App, pilot) -> None:
    """Wait for the pane's estimate: it runs in a thread (VramPane._estimate), which a loaded machine
    (the GPU box's 14 test workers) may not have finished when the app has started."""
    await pilot.pause()  # messages first: one may start an estimate (a sampled card does)
    await app.workers.wait_for_complete()
    await pilot.pause()


def sample(pane: VramPane, event: ev.MemorySampled) -> None:
    """Deliver ``event`` to the pane as the app does: a MemorySample message for the followed run."""
    pane.post_message(MemorySample(None, event))


@pytest.fixture(autouse=True)
def no_detected_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pane as on a machine without a GPU: its default card, sizes and snapshots are then the
    same on every machine (on a GPU box the detected card would otherwise come first)."""
    monkeypatch.setattr(vram_pane, "capacity_choices", lambda: list(KNOWN_GPUS))


@pytest.mark.anyio
async def test_a_detected_card_is_the_default_and_wins_over_the_events_figure(monkeypatch) -> None:
    card = Gpu("NVIDIA H100 80GB HBM3", 81559 * 2**20, detected=True)
    monkeypatch.setattr(vram_pane, "capacity_choices", lambda: [card, *KNOWN_GPUS])
    app = PaneApp(parse_config(LLAMA_CONFIG))
    async with app.run_test(size=SIZE) as pilot:
        await estimated(app, pilot)
        pane = app.query_one(VramPane)
        assert pane.gpu == card
        sample(pane, ev.MemorySampled(step=1, device="another card", capacity=16 * 2**30,
                                      categories={"weights": GB}))
        await pilot.pause()
        assert app.query_one(BlockGauge).capacity == card.capacity


def test_scale_is_one_gb_for_big_runs_and_finer_for_small_models():
    assert choose_unit(9 * GB, 16 * GB) == GB
    assert choose_unit(int(2.7 * GB), 24 * GB) == 0.1 * GB
    assert choose_unit(int(0.3 * GB), None) < 0.1 * GB
    assert choose_unit(300 * GB, 80 * GB) > GB  # 300 one-GB squares would not fit: coarser


def test_each_square_takes_the_category_that_owns_its_middle():
    squares = square_categories({"weights": 3 * GB, "lora": GB // 4, "activations": 2 * GB}, GB)
    assert squares == ["weights", "weights", "weights", "activations", "activations", "activations"]


@pytest.mark.anyio
async def test_pane_estimates_the_app_config_and_steps_through_the_walkthrough():
    app = PaneApp(parse_config(LLAMA_CONFIG))
    async with app.run_test(size=SIZE) as pilot:
        await estimated(app, pilot)
        pane = app.query_one(VramPane)
        gauge = app.query_one(BlockGauge)
        assert pane.current is not None and gauge.predicted == pane.current.categories
        await pilot.press("w")
        first = dict(gauge.predicted)
        for _ in range(6):
            await pilot.press("right")
        last = dict(gauge.predicted)
        assert pane.step_index == 6
        assert sum(first.values()) > 10 * sum(last.values())  # full fp32 vs paged QLoRA
        await pilot.press("w")
        assert gauge.predicted == pane.current.categories


@pytest.mark.anyio
async def test_measured_squares_fill_in_from_memory_events():
    app = PaneApp(parse_config(LLAMA_CONFIG))
    async with app.run_test(size=SIZE) as pilot:
        await estimated(app, pilot)
        pane = app.query_one(VramPane)
        measured = {"weights": 4_401_000_000, "lora": 160_000_000, "gradients": 160_000_000,
                    "optimizer": 320_000_000, "activations": 2_200_000_000, "overhead": 1_280_000_000}
        sample(pane, ev.MemorySampled(step=3, device="NVIDIA H100 80GB HBM3", capacity=80 * 2**30,
                                      categories=measured))
        await estimated(app, pilot)  # a sampled card re-estimates (in the thread again)
        gauge = app.query_one(BlockGauge)
        assert gauge.measured == measured
        assert gauge.capacity == 80 * 2**30


@pytest.mark.anyio
async def test_a_config_that_does_not_fit_says_so(monkeypatch):
    # The plain path (the fast one checkpoints every layer whatever the config says, and would fit)
    monkeypatch.setenv("STUDIO_FAST_PATH", "0")
    config = parse_config(LLAMA_CONFIG + "quantization: {bits: null}\ntrainer: {micro_batch_size: 16, "
                          "gradient_checkpointing: false}\n")
    app = PaneApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await estimated(app, pilot)
        pane = app.query_one(VramPane)
        assert pane.current is not None and pane.current.fits is False
        assert "does NOT fit" in str(app.query_one("#vram-summary").render())
        assert "plain path" in str(app.query_one("#vram-summary").render())


def test_snapshot_small_model_default_config(snap_compare):
    assert snap_compare(PaneApp(RunConfig()), terminal_size=SIZE)


def test_snapshot_llama_with_measured(snap_compare):
    async def run_before(pilot):
        sample(pilot.app.query_one(VramPane), ev.MemorySampled(
            step=2, capacity=0, categories={"weights": 4_401_000_000, "lora": 160_000_000,
                                            "gradients": 160_000_000, "optimizer": 320_000_000,
                                            "activations": 2_300_000_000, "overhead": 1_800_000_000}))
        await pilot.pause()

    assert snap_compare(PaneApp(parse_config(LLAMA_CONFIG)), terminal_size=SIZE, run_before=run_before)


def test_snapshot_walkthrough_first_and_qlora_steps(snap_compare):
    assert snap_compare(PaneApp(parse_config(LLAMA_CONFIG)), terminal_size=SIZE, press=["w"])
    assert snap_compare(PaneApp(parse_config(LLAMA_CONFIG)), terminal_size=SIZE,
                        press=["w", "right", "right", "right", "right"])


@pytest.mark.anyio
async def test_a_full_fine_tune_config_shows_its_own_estimate_in_the_predicted_column():
    config = parse_config(LLAMA_CONFIG + "lora: null\n")
    app = PaneApp(config)
    async with app.run_test(size=SIZE) as pilot:
        await estimated(app, pilot)
        pane = app.query_one(VramPane)
        gauge = app.query_one(BlockGauge)
        assert pane.current is not None and gauge.predicted == pane.current.categories
        params = 6_738_415_616  # Llama-2-7B: bf16 weights and gradients, torch AdamW's bf16 m and v
        assert (gauge.predicted["weights"], gauge.predicted["gradients"], gauge.predicted["optimizer"]) == (
            2 * params, 2 * params, 4 * params)
        assert gauge.predicted["lora"] == 0
        summary = str(app.query_one("#vram-summary").render())
        assert "full fine-tune" in summary and "plain path" in summary


@pytest.mark.anyio
async def test_on_a_cpu_the_gauge_says_what_it_shows_before_and_after_a_run(tmp_path, monkeypatch):
    """No GPU here: before any run the measured side says why it is empty (not "waiting for the
    worker" forever); after a CPU run each side names its setup, and the gap is called a difference
    of setups, not an error of the estimate."""
    from helpers.ui import PlayedWorker, panes_mounted
    from textual.widgets import Static

    from studio.core.runs import create_run
    from studio.ui.app import StudioApp

    monkeypatch.chdir(tmp_path)
    config = parse_config(LLAMA_CONFIG)
    app = StudioApp(config, settings=False, initial_pane="vram")
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        await estimated(app, pilot)
        gauge = app.query_one(BlockGauge)

        def shown() -> str:
            return "\n".join(line.plain for line in app.query_one(BlockGauge).render().renderables)

        assert "waiting for the worker" not in shown()
        assert "no GPU on this machine" in shown() and "measures CPU memory" in shown()
        assert "for L4 24 GB, NF4 weights" in shown()
        app.open_run(create_run(config))
        worker.feed([ev.ModelLoaded(base_model="meta-llama/Llama-2-7b-hf", device="cpu", dtype="float32",
                                    quantization="float32"),
                     ev.MemorySampled(step=1, device="cpu", categories={"weights": 27 * GB, "lora": GB // 2})])
        for _ in range(100):
            if gauge.measured:
                break
            await pilot.pause(0.05)
        await pilot.pause(0.1)
        text = shown()
        assert "on CPU, FP32 weights" in text and "for L4 24 GB, NF4 weights" in text
        assert "different setups" in text and "not the estimate's error" in text
        assert app.query_one(VramPane).query_one("#vram-summary", Static)  # the estimate is still there


class GaugeApp(App):
    def compose(self) -> ComposeResult:
        yield BlockGauge()


@pytest.mark.anyio
async def test_a_mixture_of_experts_draws_its_experts_apart_and_a_dense_model_has_no_such_line():
    """Qwen3-30B-A3B's estimate: the 4-bit experts are their own squares and legend line, in a
    colour of their own; a dense model's legend has no experts line."""
    from rich.console import Console

    from studio.core.memory import estimate
    from studio.core.model.info import from_config_dict
    from studio.ui.widgets.block_gauge import CATEGORY_COLOURS

    qwen3_moe = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True}
    predicted = estimate(parse_config("model: {base_model: Qwen/Qwen3-30B-A3B}\n"),
                         from_config_dict(qwen3_moe, "Qwen/Qwen3-30B-A3B"), 24 * GB).categories
    assert predicted["experts"] > 2 * predicted["weights"]
    squares = square_categories(predicted, GB)
    assert squares.count("experts") >= 14 and squares[0] == "weights"

    def legend(gauge: BlockGauge) -> str:
        console = Console(width=120, record=True)
        console.print(gauge.render())
        return console.export_text()

    app = GaugeApp()
    async with app.run_test(size=SIZE):
        gauge = app.query_one(BlockGauge)
        assert gauge._colour(CATEGORY_COLOURS["experts"]) != gauge._colour(CATEGORY_COLOURS["weights"])
        gauge.predicted, gauge.capacity = predicted, 24 * GB
        assert f"experts        {predicted['experts'] / GB:.2f} GB" in legend(gauge)
        gauge.predicted = {**predicted, "experts": 0}
        assert "experts" not in legend(gauge) and "weights" in legend(gauge)
