"""`studio train` and `studio eval` end to end on the tiny model: the fine-tune beats the base."""

from __future__ import annotations

import json
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
from helpers.cli import run_studio, start_studio

from studio.cli import main as studio_main
from studio.core import events as ev
from studio.core.runs import RunDir, iter_events

FINE_TUNE_STEPS = 300


@pytest.fixture(scope="module")
def trained(make_tiny_config, tmp_path_factory, studio_env) -> tuple[RunDir, str]:
    """The tiny model fine-tuned on reverse-word rows through `python -m studio.cli train`:
    (the run, what the command printed)."""
    work = tmp_path_factory.mktemp("train-cli")
    config = make_tiny_config(work / "runs")
    config.trainer.eval_interval = 100
    config.trainer.checkpoint_interval = 100
    config.trainer.log_interval = 25
    config.save(work / "reverse.yaml")
    done = run_studio("train", str(work / "reverse.yaml"), "--max-steps", str(FINE_TUNE_STEPS), cwd=work, env=studio_env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [p for p in (work / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1
    return RunDir(runs[0]), done.stdout


@pytest.fixture(scope="module")
def evaluated(trained) -> dict:
    """`studio eval RUN --json` on the trained run."""
    run, _ = trained
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = studio_main(["eval", str(run.path), "--json", "--rows", "40"])
    assert code == 0
    return json.loads(out.getvalue())


@pytest.mark.slow
def test_train_writes_the_run_and_prints_progress(trained) -> None:
    run, stdout = trained
    assert f"step {FINE_TUNE_STEPS}/{FINE_TUNE_STEPS}" in stdout
    step_lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == FINE_TUNE_STEPS // 25
    assert all(k in step_lines[-1] for k in ("loss", "lr", "tok/s", "mem"))
    assert "eval at step 300" in stdout
    assert (run.path / "config.yaml").exists()
    assert (run.adapter_dir / "adapter_config.json").exists()
    events = list(iter_events(run.events_path))
    assert [e.seq for e in events] == list(range(len(events)))
    steps = [e for e in events if isinstance(e, ev.StepLogged)]
    assert [e.step for e in steps] == list(range(25, FINE_TUNE_STEPS + 1, 25))
    assert steps[-1].loss < steps[0].loss
    assert all(e.tokens_per_s > 0 for e in steps)
    evals = [e for e in events if isinstance(e, ev.EvalLogged)]
    # Step 0 is the base model, evaluated before the first step.
    assert [e.step for e in evals] == [0, 100, 200, 300]
    assert "eval of the base model (step 0)" in stdout
    assert evals[-1].loss < evals[1].loss < evals[0].loss and 0 < evals[-1].token_accuracy <= 1
    assert [e.step for e in events if isinstance(e, ev.CheckpointSaved)] == [100, 200, 300]
    assert [p.name for p in run.checkpoints()] == ["step-200", "step-300"]
    # The foreground run is the worker, so its log ends with the worker's exit right after training.
    assert isinstance(events[-1], ev.WorkerStopped)
    assert isinstance(events[-2], ev.TrainingFinished) and not events[-2].stopped


@pytest.mark.slow
def test_fine_tuned_answers_beat_the_base_on_held_out_rows(trained, evaluated) -> None:
    run, _ = trained
    assert evaluated["split"] == "test" and evaluated["rows"] == 40
    base, tuned = evaluated["base"], evaluated["fine_tuned"]
    print(f"held-out exact match: base {base['exact_match']:.1%} -> fine-tuned {tuned['exact_match']:.1%}; "
          f"similarity {base['similarity']:.2f} -> {tuned['similarity']:.2f}")
    assert base["exact_match"] <= 0.05
    assert tuned["exact_match"] >= 0.2
    assert tuned["exact_match"] > base["exact_match"]
    assert tuned["similarity"] > base["similarity"]
    saved = json.loads((run.path / "eval.json").read_text())
    assert saved["fine_tuned"] == tuned


@pytest.mark.slow
def test_saved_adapter_reproduces_the_fine_tuned_answers(trained, evaluated, tiny_model) -> None:
    """PeftModel.from_pretrained on runs/<id>/adapter + transformers' own greedy generate."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(run.adapter_dir))
    model.eval()
    for row in evaluated["results"][:12]:
        ids = torch.tensor([tokenizer.encode(row["prompt"], add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        assert answer == row["tuned"]


def test_eval_table_and_errors(trained, evaluated, capsys) -> None:
    run, _ = trained
    assert studio_main(["eval", str(run.path), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "target" in out and "fine-tuned" in out and "exact match: base" in out
    assert studio_main(["eval", str(run.path / "nope")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err


def test_eval_of_a_run_without_adapter_says_what_to_do(tiny_config, capsys) -> None:
    from studio.core.runs import create_run

    run = create_run(tiny_config)
    assert studio_main(["eval", str(run.path)]) == 1
    err = capsys.readouterr().err
    assert "no adapter yet" in err and "studio stop" in err and len(err.strip().splitlines()) == 1


def test_train_user_errors_are_one_line(tmp_path: Path, tiny_config, capsys) -> None:
    assert studio_main(["train", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "missing.yaml" in err and "no such config file" in err and "Traceback" not in err

    tiny_config.data.path = str(tmp_path / "nowhere.jsonl")
    tiny_config.save(tmp_path / "bad-data.yaml")
    assert studio_main(["train", str(tmp_path / "bad-data.yaml")]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("error")]
    assert len(failed) == 1 and "(data)" in failed[0] and "nowhere.jsonl" in failed[0]
    assert "Traceback" not in out


STUDIO_LINES = ("run directory: ", "loading model: ", "warning (", "model loaded: ", "training started: ",
                "eval ", "step ", "checkpoint at step ", "training finished at step ",
                "compare base and fine-tuned answers with: ")
"""How every line of a foreground `studio train` that trains and ends well begins."""


@pytest.mark.slow
def test_the_console_of_a_cpu_run_holds_only_studio_lines(tiny_config, tmp_path: Path, studio_env) -> None:
    """A 4-bit config trained on the CPU: stdout and stderr together are Studio's lines only (no
    bitsandbytes kernel notice, no transformers "Loading weights" bar, no FutureWarning), and the
    CPU note is there once, as a warning. What the libraries said is in worker.log."""
    tiny_config.quantization.bits = 4
    tiny_config.trainer.max_steps = 2
    tiny_config.trainer.eval_interval = 0
    tiny_config.save(tmp_path / "cpu.yaml")
    done = run_studio("train", str(tmp_path / "cpu.yaml"), cwd=tmp_path, env={**studio_env, "STUDIO_DEVICE": "cpu"}, timeout=300, merge_stderr=True)
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert [line for line in lines if not line.startswith(STUDIO_LINES)] == [], done.stdout
    notes = [line for line in lines if "no CUDA GPU" in line]
    assert len(notes) == 1 and notes[0].startswith("warning (config): no CUDA GPU: loading the base in float32")


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tiny_config, tmp_path: Path, studio_env) -> None:
    tiny_config.trainer.max_steps = 5000
    tiny_config.trainer.checkpoint_interval = 0
    tiny_config.save(tmp_path / "long.yaml")
    runs = tmp_path / "elsewhere"  # --runs-dir wins over the config's output_dir
    proc = start_studio("train", str(tmp_path / "long.yaml"), "--runs-dir", str(runs), cwd=tmp_path, env=studio_env)
    deadline = time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            found = list(runs.glob("*/events.jsonl")) if runs.exists() else []
            if found and any(isinstance(e, ev.StepLogged) for e in iter_events(found[0])):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "continue with: studio train --resume" in out and "Traceback" not in out
    run = RunDir(next(runs.glob("*/events.jsonl")).parent)
    finished = [e for e in iter_events(run.events_path) if isinstance(e, ev.TrainingFinished)]
    assert len(finished) == 1 and finished[0].stopped and 0 < finished[0].step < 5000
    assert run.latest_checkpoint() == run.checkpoints_dir / f"step-{finished[0].step}"
    assert (run.adapter_dir / "adapter_model.safetensors").exists()
    # The printed command, typed in the same folder (the runs are not in ./runs), continues the run.
    printed = re.search(r"continue with: (studio train --resume .+)$", out, re.MULTILINE)
    assert printed is not None, out
    words = shlex.split(printed.group(1))
    stopped_at = finished[0].step
    resumed = run_studio(*words[1:], "--max-steps", str(stopped_at + 2), cwd=tmp_path, env=studio_env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    events = list(iter_events(run.events_path))
    assert [e.resumed_from_step for e in events if isinstance(e, ev.RunStarted)][-1] == stopped_at
    assert [e.step for e in events if isinstance(e, ev.TrainingFinished)][-1] == stopped_at + 2


@pytest.mark.slow
def test_attach_follows_a_foreground_run_live_until_it_finishes(tiny_config, tmp_path: Path, studio_env,
                                                                capsys: pytest.CaptureFixture) -> None:
    """`studio train CONFIG` without --detach has no worker socket: `studio runs` still says
    "training" (not "interrupted") and `studio attach` follows its log to the end."""
    from studio.core.runs import summarize

    tiny_config.trainer.max_steps = 150
    tiny_config.trainer.checkpoint_interval = 0
    tiny_config.trainer.eval_interval = 0
    tiny_config.save(tmp_path / "fg.yaml")
    proc = start_studio("train", str(tmp_path / "fg.yaml"), cwd=tmp_path, env=studio_env, quiet=True)
    runs = Path(tiny_config.output_dir)
    try:
        deadline = time.time() + 180
        run = None
        while time.time() < deadline and proc.poll() is None:
            found = list(runs.glob("*/events.jsonl")) if runs.exists() else []
            if found and any(isinstance(e, ev.StepLogged) for e in iter_events(found[0])):
                run = RunDir(found[0].parent)
                break
            time.sleep(0.05)
        assert run is not None and proc.poll() is None, "the run did not start training"
        assert run.worker_pid() == proc.pid
        assert summarize(run).status == "training"
        assert studio_main(["attach", run.id, "--runs-dir", str(runs)]) == 0
        # Every step is printed once, on one line with its memory: the ones logged before attach
        # from the file, the rest live.
        out = capsys.readouterr().out
        assert "training finished at step 150" in out and "interrupted" not in out
        assert [int(s) for s in re.findall(r"step +(\d+)/150", out)] == list(range(1, 151))
        assert [line for line in out.splitlines() if re.search(r"\bstep 1\b", line)] == \
            [line for line in out.splitlines() if "step 1/150" in line and "  mem " in line]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run.worker_pid() is None and not run.pid_path.exists()
    assert summarize(run).status == "finished"
