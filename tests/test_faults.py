"""Faults a careful user or a hostile local process can cause (issue 19, its runtime half): a silent
connection, loose file modes, a full disk, out-of-memory outside forward/backward, a damaged
checkpoint. Disk-full tests are in tests/test_disk_full.py."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from test_worker import wait_for
from test_worker_cli import fake_cli  # noqa: F401  (fixture)

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.runs import find_run
from studio.worker.client import WorkerClient


def test_a_silent_connection_does_not_block_pause(fake_cli: Path,  # noqa: F811
                                                  capsys: pytest.CaptureFixture) -> None:
    assert studio(["train", str(fake_cli), "--detach", "--max-steps", "400"]) == 0
    run = find_run(capsys.readouterr().out.strip())
    client = WorkerClient(run)
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 2, seen=[])

    # Opens the socket and never answers the key challenge.
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    for sock in silent:
        sock.connect(run.socket_address())
    started = time.monotonic()
    assert studio(["pause", run.id]) == 0
    assert time.monotonic() - started < 10
    assert "paused run" in capsys.readouterr().out

    # The silent ones are hung up on once the handshake time is over.
    for sock in silent:
        sock.settimeout(15)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk  # the challenge, then end of file
        assert data.startswith(b"\x00\x00\x00")  # the length-prefixed challenge it never answered
        sock.close()
    assert studio(["stop", run.id]) == 0
    client.close()
