"""The VRAM pane's model field in the real app: a person types a model, the estimate and the
walkthrough follow it (read in a thread), the pane says which model it shows, and the run's config
stays as it was unless they press u. Offline, as on this machine: no Hub."""

from __future__ import annotations

import json

import pytest
from helpers.ui import idle_workers, make_config, settle, workdir
from textual.widgets import Select

from studio.core import plan
from studio.core.memory import gpus
from studio.core.memory.gpus import GB
from studio.ui.app import StudioApp
from studio.ui.panes.vram import VramPane
from studio.ui.widgets.block_gauge import BlockGauge

pytestmark = pytest.mark.anyio
SIZE = (140, 44)
LLAMA = "meta-llama/Llama-2-7b-hf"


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """A working directory, empty caches, the Hub unreachable, no GPU (the card list is the known one)."""
    workdir(tmp_path, monkeypatch)
    monkeypatch.setenv("STUDIO_CACHE", str(tmp_path / "studio-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # connection refused, at once
    monkeypatch.setattr(gpus, "detect_gpus", list)


def text(app, selector: str) -> str:
    return str(app.query_one(selector).render())


async def open_vram(pilot) -> VramPane:
    await settle(pilot, rounds=1)
    return pilot.app.query_one(VramPane)


async def enter_model(pilot, ref: str) -> None:
    """m (focus the field), select what is there, type ``ref``, Enter; wait for the estimate."""
    await pilot.press("m")
    field = pilot.app.query_one("#vram-model")
    field.value = ""
    for key in ref:
        await pilot.press(key if key != "/" else "slash")
    await pilot.press("enter")
    await idle_workers(pilot)
    await pilot.pause()


async def pick_card(pilot, name: str) -> None:
    select = pilot.app.query_one("#vram-gpu", Select)
    pane = pilot.app.query_one(VramPane)
    select.value = next(k for k, g in enumerate(pane._cards) if g.name == name)
    await idle_workers(pilot)
    await pilot.pause()


async def test_llama_2_7b_offline_walks_from_full_fp32_to_paged_qlora_on_a_16_gb_card():
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        pane = await open_vram(pilot)
        await pick_card(pilot, "T4 16 GB")
        await enter_model(pilot, LLAMA)
        line = text(app, "#vram-model-line")
        assert line.startswith(f"Model: {LLAMA}, from Studio's bundled config.json (the Hub could not be "
                               "reached: offline?)")
        assert "not the run's model (tok)" in line
        assert app.config.model.base_model == "tok"  # the field never edits the config
        assert "on T4 16 GB" in text(app, "#vram-summary")

        await pilot.press("escape", "w")
        assert "Step 1/7: Full fine-tune, fp32" in text(app, "#vram-walk")
        full = app.query_one(BlockGauge).predicted
        assert 26.5 * GB < full["weights"] < 28.5 * GB  # 6.74B parameters x 4 bytes
        assert 96 * GB < full["weights"] + full["gradients"] + full["optimizer"] < 112 * GB  # 16 B a parameter
        assert pane._shown().fits is False

        await pilot.press("right", "right", "right", "right")
        assert "Step 5/7: NF4 QLoRA" in text(app, "#vram-walk")
        nf4 = app.query_one(BlockGauge).predicted
        assert 3.5 * GB < nf4["weights"] < 4.5 * GB  # packed 4-bit linears + fp32 embeddings and head

        await pilot.press("right", "right")
        assert "Step 7/7: + paged 8-bit AdamW" in text(app, "#vram-walk")
        assert pane._shown().fits is True  # the classic story: 7B on a 16 GB card


async def test_an_unreachable_unknown_id_says_what_to_do_and_draws_no_numbers():
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        await open_vram(pilot)
        await enter_model(pilot, "someone/new-model-7b")
        assert text(app, "#vram-summary") == ("Cannot estimate: could not reach the Hub for someone/new-model-7b "
                                              "(offline?): give a local folder or a config.json path")
        assert text(app, "#vram-model-line") == "Model: someone/new-model-7b"
        assert app.query_one(BlockGauge).predicted is None
        assert " GB" not in text(app, "#vram-gauge").split("Measured")[0]  # no predicted number at all


async def test_an_architecture_it_cannot_model_names_what_is_missing(tmp_path):
    (tmp_path / "qwen2-moe.json").write_text(json.dumps(
        {"model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24, "num_experts": 60}))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"n_embd": 768, "n_layer": 12, "n_head": 12}))
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        await open_vram(pilot)
        await enter_model(pilot, "qwen2-moe.json")
        assert "qwen2_moe: mixture-of-experts layers (num_experts: 60) with a shared expert" in text(
            app, "#vram-summary")
        assert app.query_one(BlockGauge).predicted is None
        await enter_model(pilot, "gpt2")
        assert "config.json has no hidden_size, intermediate_size, num_hidden_layers" in text(app, "#vram-summary")
        assert app.query_one(BlockGauge).predicted is None


async def test_a_phi3_folder_is_sized_with_its_fused_modules_and_the_config_is_untouched(tmp_path):
    (tmp_path / "phi3").mkdir()
    (tmp_path / "phi3" / "config.json").write_text(json.dumps({
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}))
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        pane = await open_vram(pilot)
        await enter_model(pilot, "phi3")
        assert text(app, "#vram-model-line").startswith("Model: phi3, from model folder")
        summary = text(app, "#vram-summary")
        assert "LoRA r16" in summary and "fast path" in summary  # fused modules run on the fast path
        assert pane.current.plan.lora_targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        assert app.config.lora.target_modules == "all-linear"


async def test_u_makes_the_field_the_runs_model_and_an_empty_field_goes_back_to_it():
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        await open_vram(pilot)
        await enter_model(pilot, LLAMA)
        await pilot.press("escape", "u")
        await idle_workers(pilot)
        await pilot.pause()
        assert app.config.model.base_model == LLAMA
        assert text(app, "#vram-model-line") == f"Model: {LLAMA} (the run's model.base_model)"
        await enter_model(pilot, "")
        assert text(app, "#vram-model-line") == f"Model: {LLAMA} (the run's model.base_model)"
        assert "fits" in text(app, "#vram-summary")


async def test_qwen3_8b_offline_is_sized_from_its_bundled_config_on_the_path_the_engine_takes(monkeypatch):
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        pane = await open_vram(pilot)
        await enter_model(pilot, "Qwen/Qwen3-8B")
        assert text(app, "#vram-model-line").startswith(
            "Model: Qwen/Qwen3-8B, from Studio's bundled config.json (the Hub could not be reached: offline?)")
        assert "fast path" in text(app, "#vram-summary")  # the engine runs Qwen3's per-head q/k norms
        assert pane.current.plan.lora_targets[0] == "q_proj"
        monkeypatch.setattr(plan, "FAST_DECODER_FEATURES", frozenset())  # the engine before it ran them
        await pick_card(pilot, "T4 16 GB")  # a new (config, card) pair: estimated afresh
        for _ in range(600):  # the card's change reaches the pane, then its estimate, in their own time
            if "T4 16 GB" in text(app, "#vram-summary"):
                break
            await pilot.pause(0.05)
        assert "plain path" in text(app, "#vram-summary") and "T4 16 GB" in text(app, "#vram-summary")


async def test_gpt_oss_offline_says_its_experts_stay_mxfp4():
    """openai/gpt-oss-20b typed offline: the gauge draws its experts apart, and both the summary and
    the gauge's setup say the experts stay in the MXFP4 they ship in while the rest loads in NF4."""
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        await open_vram(pilot)
        await enter_model(pilot, "openai/gpt-oss-20b")
        assert "; nf4 + mxfp4 experts, LoRA r" in text(app, "#vram-summary")
        gauge = app.query_one(BlockGauge)
        assert gauge.predicted_setup.endswith("NF4 weights, MXFP4 experts")
        assert 9.5 * GB < gauge.predicted["experts"] < 11 * GB  # 19.1B expert weights at 4.25 bits
