"""`studio mcp` as an agent drives it: the MCP SDK's client session, over stdio, against a `studio mcp`
subprocess. The first test uses the torch-free FakeTrainer in the workers it starts (start, pause,
resume, stop in seconds); the second trains the tiny model through a real worker started by the
server, then exports and evaluates it there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

# The SDK is the `mcp` extra (and in `test`); a machine without it (the GPU box) skips the file.
mcp = pytest.importorskip("mcp")
from helpers import REPO, TESTS  # noqa: E402
from helpers.cli import studio_command  # noqa: E402
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

from studio.cli import main as studio  # noqa: E402
from studio.core.config import ConfigNote, load_config  # noqa: E402
from studio.core.runs import create_run, list_runs  # noqa: E402
from studio.worker.launch import GpuLock  # noqa: E402

TOOLS = {"list_runs", "run_status", "estimate", "start_run", "pause_run", "resume_run", "stop_run", "eval_run",
         "export_run"}


@contextlib.asynccontextmanager
async def studio_mcp(runs: Path, log: Path) -> AsyncIterator[ClientSession]:
    """A `studio mcp --runs-dir RUNS` subprocess (this process's environment) and a session with it."""
    command, *args = studio_command("mcp", "--runs-dir", runs)
    params = StdioServerParameters(command=command, args=args,
                                   env=dict(os.environ), cwd=str(runs.parent))
    with open(log, "w") as errors:
        async with stdio_client(params, errlog=errors) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool's structured answer; fails on a tool error, with its text."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content[0].text
    return result.structured_content


async def refused(session: ClientSession, tool: str, **arguments: Any) -> str:
    """The text of a tool error (fails when the tool did not refuse)."""
    result = await session.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    return result.content[0].text


async def poll_status(session: ClientSession, run_id: str, done: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = await call(session, "run_status", run=run_id)
        if done(status):
            return status
        assert time.monotonic() < deadline, status
        await anyio.sleep(0.3)


def cli_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """What the `studio` command prints after ``error: `` (it must fail with one line)."""
    capsys.readouterr()
    assert studio(argv) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.removeprefix("error: ").strip()


@pytest.fixture
def server_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private device lock, tests/ importable by workers; leftover workers are killed at the end."""
    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), str(TESTS),
                                                                    os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "runs"
    for run in list_runs(tmp_path / "runs"):
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)


def test_an_agent_starts_pauses_resumes_and_stops_a_run_and_reading_starts_nothing(
        server_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.worker_fakes:FakeTrainer")
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "2")
    monkeypatch.setenv("FAKE_STEP_S", "0.05")
    runs = server_env
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    config = tmp_path / "fake.yaml"
    # lora_alpha is PEFT's name for lora.alpha: read as Studio's, with a note.
    config.write_text("model:\n  base_model: fake-model\ndata:\n  path: rows.jsonl\nlora:\n  lora_alpha: 32\n")
    with pytest.warns(ConfigNote):
        untouched = create_run(load_config(config), runs)  # a run that no one started

    async def agent() -> None:
        async with studio_mcp(runs, tmp_path / "server.log") as session:
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
            assert set(tools) == TOOLS
            for tool in tools.values():
                assert tool.description and tool.output_schema, tool.name
                assert all(p.get("description") for p in tool.input_schema["properties"].values()), tool.name
            assert {name for name, t in tools.items() if t.annotations.read_only_hint} == \
                {"list_runs", "run_status", "estimate"}
            assert tools["stop_run"].annotations.destructive_hint

            # Resources and read-only tools only read: no worker, no device lock, no new event.
            listed = json.loads((await session.read_resource("studio://runs")).contents[0].text)
            assert [r["id"] for r in listed["runs"]] == [untouched.id] and listed["runs"][0]["status"] == "created"
            text = (await session.read_resource(f"studio://runs/{untouched.id}/config")).contents[0].text
            assert text == untouched.config_path.read_text()
            assert (await session.read_resource(f"studio://runs/{untouched.id}/events")).contents[0].text == "\n"
            status = await call(session, "run_status", run=untouched.id)
            assert status["status"] == "created" and status["worker"] is None
            assert untouched.worker_pid() is None and not untouched.events_path.exists() and not GpuLock().busy()

            started = await call(session, "start_run", config=str(config), max_steps=400)
            assert started["notes"] and "lora.alpha" in started["notes"][0]
            run_id = started["run_id"]
            assert Path(started["path"]).parent == runs.resolve() and started["worker_pid"] > 0
            await poll_status(session, run_id, lambda s: s["step"] >= 2, 30)

            paused = await call(session, "pause_run", run=run_id)
            assert paused["message"] == f"paused run {run_id} after step {paused['step']}; 'studio resume " \
                                        f"{run_id}' continues it"
            status = await call(session, "run_status", run=run_id)
            assert status["status"] == "paused" and status["worker"]["state"] == "paused"
            assert status["step"] == paused["step"] and status["last_loss"] is not None
            assert (await call(session, "resume_run", run=run_id))["step"] == paused["step"]
            await poll_status(session, run_id, lambda s: s["step"] > paused["step"], 30)

            stopped = await call(session, "stop_run", run=run_id)
            assert stopped["step"] > paused["step"] and Path(stopped["adapter"], "adapter_config.json").exists()
            events = (await session.read_resource(f"studio://runs/{run_id}/events")).contents[0].text
            assert f"training stopped at step {stopped['step']}" in events
            assert events.rstrip().endswith("worker stopped: shutdown requested")

            # A mistake is a tool error with the CLI's line.
            again = await refused(session, "stop_run", run=run_id)
            assert again == cli_error(["stop", run_id, "--runs-dir", str(runs)], capsys)
            assert again.startswith(f"run {run_id} has no worker running (status: stopped")
            missing = await refused(session, "start_run", config="no-such.yaml")
            assert missing == cli_error(["train", "no-such.yaml", "--detach"], capsys)
            assert "no run matching 'zzz'" in await refused(session, "pause_run", run="zzz")
            assert "libtorch" not in Path(f"/proc/{_server_pid()}/maps").read_text()

    anyio.run(agent)
    assert len(list_runs(runs)) == 2  # the refused start made no run folder
    assert untouched.worker_pid() is None and not untouched.events_path.exists()


@pytest.mark.slow
def test_an_agent_trains_the_tiny_model_estimates_exports_and_evaluates_it(
        server_env: Path, tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    from studio.engine.tiny import reverse_word_rows

    monkeypatch.setenv("STUDIO_WORKER_LINGER", "30")  # kept up between the agent's calls; stop_run ends it
    runs = server_env
    rows = tmp_path / "reverse.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in reverse_word_rows(200, seed=0)))
    tiny_config.data.path = str(rows)
    tiny_config.trainer.max_steps = 4
    tiny_config.trainer.eval_interval = 4
    tiny_config.trainer.checkpoint_interval = 4
    tiny_config.trainer.eval_max_rows = 8
    config = tmp_path / "tiny.yaml"
    tiny_config.save(config)
    capsys.readouterr()
    assert studio(["estimate", str(config), "--gpu-gb", "8", "--json"]) == 0
    cli_estimate = json.loads(capsys.readouterr().out)

    async def agent() -> None:
        async with studio_mcp(runs, tmp_path / "server.log") as session:
            by_path = await call(session, "estimate", config=str(config), gpu_gb=8)
            inline = await call(session, "estimate", config=config.read_text(), gpu_gb=8)
            assert by_path["estimate"] == inline["estimate"] == cli_estimate
            assert by_path["fits"] is True and "fits on" in by_path["text"]
            assert "no such config file" in await refused(session, "estimate", config="nope.yaml")

            run_id = (await call(session, "start_run", config=str(config)))["run_id"]
            finished = await poll_status(session, run_id, lambda s: s["status"] in ("finished", "failed"), 240)
            assert finished["status"] == "finished", finished["failure"]
            assert finished["step"] == finished["total_steps"] == 4
            assert finished["last_loss"] > 0 and finished["eval_loss"] > 0 and finished["tokens_per_s"] > 0
            assert finished["memory"]["text"] and finished["adapter"]
            assert finished["worker"]["state"] == "finished"  # kept up for chat: the next jobs reuse it
            listed = await call(session, "list_runs")
            assert [(r["id"], r["status"], r["step"]) for r in listed["runs"]] == [(run_id, "finished", 4)]

            exported = await call(session, "export_run", run=run_id)
            assert "adapter_config.json" in exported["files"]
            assert Path(exported["path"], "adapter_config.json").exists()
            progress: list[float] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                progress.append(done)

            result = await session.call_tool("eval_run", {"run": run_id, "rows": 2}, progress_callback=on_progress)
            assert not result.is_error, result.content[0].text
            scored = result.structured_content
            assert scored["rows"] == 2 and scored["split"] == "test" and len(scored["examples"]) == 2
            assert scored["fine_tuned"] is not None and json.loads(Path(scored["path"]).read_text())["rows"] == 2
            assert progress == [1, 2]

            server = _server_pid()
            assert "libtorch" not in Path(f"/proc/{server}/maps").read_text()  # the worker loaded it, not this
            stopped = await call(session, "stop_run", run=run_id)
            assert stopped["message"] == f"worker of run {run_id} shut down"

    anyio.run(agent)


def _server_pid() -> int:
    """The `studio mcp` process this test started (a child of this process)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"mcp" in cmdline:
                return int(entry.name)
    raise AssertionError("no studio mcp process")


def test_without_the_sdk_studio_mcp_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mcp" else find_spec(name, *a))
    assert studio(["mcp"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'qlora-studio[mcp]'" in err
