"""`studio train`, `studio eval` and `studio export --format gguf` end to end on a tiny gpt-oss that
ships its experts in MXFP4, on the CPU with the fast path forced (STUDIO_FAST_PATH=1): the 4-bit load
keeps the experts as shipped, the run trains LoRA on the attention and the experts on the fast path
and says so, the adapter holds the experts' PEFT target_parameters weights, `studio eval` answers
through it, and the worker writes a gpt-oss GGUF with the trained experts rounded back to MXFP4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import run_studio
from helpers.gpt_oss import mxfp4_folder

from studio.core import events as ev
from studio.core.runs import RunDir, iter_events

pytest.importorskip("bitsandbytes")
gguf = pytest.importorskip("gguf")


@pytest.mark.slow
def test_a_gpt_oss_run_trains_its_mxfp4_experts_on_the_fast_path(tmp_path: Path, reverse_data: Path,
                                                                  studio_env: dict) -> None:
    from safetensors import safe_open

    model = mxfp4_folder(tmp_path / "gpt-oss")
    (tmp_path / "run.yaml").write_text(
        f"model: {{base_model: {model}}}\nquantization: {{bits: 4, on_cpu: keep}}\n"
        "lora: {r: 8, alpha: 16, target_modules: all-linear, target_experts: true}\n"
        f"data: {{path: {reverse_data}, max_seq_length: 96}}\n"
        "trainer: {max_steps: 2, micro_batch_size: 4, effective_batch_size: 4, eval_interval: 2, eval_max_rows: 8,"
        " log_interval: 1, checkpoint_interval: 2}\n"
        f"generation: {{max_new_tokens: 4}}\noutput_dir: {tmp_path / 'runs'}\n")
    # a lock of its own: the worker the export starts lingers after it (as a run's does for the next
    # job), and would hold this test process's CPU lock for the tests after this one
    env = {**studio_env, "STUDIO_FAST_PATH": "1", "STUDIO_LOCK_DIR": str(tmp_path / "locks")}
    done = run_studio("train", tmp_path / "run.yaml", cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    run = RunDir(next((tmp_path / "runs").iterdir()))
    loaded = [e for e in iter_events(run.events_path) if isinstance(e, ev.ModelLoaded)][0]
    assert (loaded.quantization, loaded.path) == ("nf4", "fast"), loaded
    with safe_open(str(run.path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any("mlp.experts.lora_A" in n for n in names) and any("self_attn.q_proj.lora_B" in n for n in names)
    assert json.loads((run.path / "adapter" / "adapter_config.json").read_text())["target_parameters"]
    answered = run_studio("eval", run.path, "--rows", "2", "--json", cwd=tmp_path, env=env, timeout=600)
    assert answered.returncode == 0, answered.stdout + answered.stderr
    report = json.loads(answered.stdout)
    assert report["rows"] == 2 and len(report["results"]) == 2
    try:
        exported = run_studio("export", run.path, "--format", "gguf", "--quant", "mxfp4", "--out", tmp_path / "gguf",
                              cwd=tmp_path, env=env, timeout=600)
    finally:
        run_studio("stop", run.path, cwd=tmp_path, env=env, timeout=120)  # the worker the export started
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "no LoRA GGUF" in exported.stdout + exported.stderr  # the adapter is on the experts too
    reader = gguf.GGUFReader(tmp_path / "gguf" / "model-mxfp4.gguf")
    assert reader.fields["general.architecture"].contents() == "gpt-oss"
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {kinds[f"blk.{i}.ffn_{p}_exps.weight"] for i in range(2) for p in ("gate", "up", "down")} == {"MXFP4"}
