"""The memory estimate against one measurement of today's engine on the GPU: tests/data/vram_measured.json.

bench/vram_measure.py made the file in one GPU call: Studio's Trainer ran each row's run config on
random-weight models (SmolLM2-135M, Qwen3-0.6B, Llama-2-7B and Llama-3-8B shapes), one fresh process
a row, and recorded the peaks of the whole run (training steps, final evaluation, adapter save, one
chat answer). The file pinned now: 24 rows (8 out of sample) of 9058222's engine on one H200, the
fast path's including Qwen3-0.6B's (q/k norms, 16 query heads on 8 key/value heads). Each row is
estimated here as ``studio estimate`` estimates its config, and held to
issue 18's bar: reserved memory within 3% median and 7% worst, over every row and over the third
marked out of sample, which the estimator's constants are never fitted on.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest
import yaml
from helpers import DATA

from studio.core.config import parse_config
from studio.core.memory import Estimate, estimate, estimate_plan
from studio.core.model.info import from_config_dict

MEASURED = DATA / "vram_measured.json"


@pytest.fixture(scope="module")
def measured() -> dict:
    if not MEASURED.exists():
        pytest.skip("tests/data/vram_measured.json is not there yet: one GPU call of bench/vram_measure.py makes "
                    "it (the command is in that script's docstring)")
    return json.loads(MEASURED.read_text())


@pytest.fixture
def rows(measured: dict, monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, Estimate]]:
    """Every measured row with the estimate of its run config, in the environment the rows ran in
    (the estimate reads the allocator setting and STUDIO_FAST_PATH as the engine does)."""
    monkeypatch.delenv("STUDIO_FAST_PATH", raising=False)
    alloc_conf = measured["environment"]["PYTORCH_CUDA_ALLOC_CONF"]
    if alloc_conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", alloc_conf)
    out = []
    for row in measured["rows"]:
        if "peak_reserved" not in row["measured"]:
            continue  # failed or skipped on the GPU: the file says why
        config = parse_config(yaml.safe_dump(row["config"]))
        info = from_config_dict(dict(measured["models"][row["model"]]), row["model"])
        # the run's longest examples: unpacked steps are sized from the data, as studio estimate does
        out.append((row, estimate(config, info, lengths=tuple(row["measured"]["longest_examples"]))))
    return out


def test_the_file_is_one_measurement_of_todays_engine_on_a_gpu(measured: dict, rows: list):
    """One engine (every row's version is the file's commit), its command, GPU and versions; at
    least 20 rows on both paths, several models, micro-batches, lengths and ranks, a third out of sample."""
    for key in ("command", "commit", "engine", "gpu", "versions"):
        assert measured[key], key
    assert not measured["cpu_only"] and measured["gpu"] != "cpu"
    assert measured["commit"].startswith(measured["engine"])
    assert {row["engine"] for row in measured["rows"]} == {measured["engine"]}
    assert len(rows) >= 20
    assert 3 * sum(row["out_of_sample"] for row, _ in rows) >= len(rows)
    assert {row["measured"]["path"] for row, _ in rows} == {"fast", "plain"}
    configs = [row["config"] for row, _ in rows]
    assert len({row["model"] for row, _ in rows}) >= 3
    for values in ([c["trainer"]["micro_batch_size"] for c in configs], [c["data"]["max_seq_length"] for c in configs],
                   [c["lora"]["r"] for c in configs]):
        assert len(set(values)) >= 3


def test_the_estimate_takes_the_path_the_engine_took(rows: list):
    assert [(row["label"], e.path) for row, e in rows] == [(row["label"], row["measured"]["path"]) for row, _ in rows]


def test_reserved_memory_is_within_3_percent_median_and_7_percent_worst(rows: list):
    """The estimate's peak reserved over every phase of the run against the run's (training, final
    evaluation, adapter save and the chat answer): what decides whether a plan fits the card."""
    errors = {row["label"]: e.peak_reserved / row["measured"]["peak_reserved"] - 1 for row, e in rows}
    out_of_sample = [errors[row["label"]] for row, _ in rows if row["out_of_sample"]]
    shown = "\n".join(f"{label}: {error:+.1%}" for label, error in errors.items())
    assert statistics.median(abs(e) for e in errors.values()) <= 0.03, shown
    assert statistics.median(abs(e) for e in out_of_sample) <= 0.03, shown
    assert max(abs(e) for e in errors.values()) <= 0.07, shown


def test_the_chat_answers_kv_cache_is_where_the_estimate_puts_it(measured: dict, rows: list):
    """The session asks the estimate's generation phase where an answer's KV cache goes (the card,
    or the host when on the card it could need more than the training step), for the run's config
    and the prompt it got: every row kept it where the estimate says."""
    for row, _ in rows:
        m = row["measured"]
        info = from_config_dict(dict(measured["models"][row["model"]]), row["model"])
        config = parse_config(yaml.safe_dump(row["config"]))
        asked = replace(estimate(config, info).plan, generate_prompt_tokens=m["generate_prompt_tokens"],
                        generate_new_tokens=m["generate_new_tokens"])
        on_host = estimate_plan(info, asked).phases["generation"].host_kv
        assert on_host is (m["generate_kv_cache"] == "host"), row["label"]
