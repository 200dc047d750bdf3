"""The tiny model's build when several processes ask for it at once (pytest-xdist workers sharing
``STUDIO_TEST_CACHE`` did: one copied the folder while another renamed its build into place, and
tests failed with "this folder has no config.json")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO

_BUILD = """
import sys
from studio.engine.tiny import build_tiny_model
log = open(sys.argv[2], "a")
path = build_tiny_model(sys.argv[1], progress=lambda m: (log.write(m + "\\n"), log.flush()), pretrain_steps=3)
print((path / "config.json").exists())
"""


def test_builders_at_once_build_once_and_each_gets_a_whole_model(tmp_path: Path) -> None:
    target, log = tmp_path / "tiny-llama", tmp_path / "progress.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(target), str(log)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _out, err in results]
    # Every process got a folder with the model in it when build_tiny_model returned.
    assert [out.strip() for out, _err in results] == ["True"] * 3
    # One of them built it; the others waited on the lock and found it finished.
    said = log.read_text().splitlines()
    assert said.count("building the tiny model") == 1
    # A process that found the lock taken said it was waiting; one that asked after the build had
    # finished found it complete without waiting. Either way, at most the two that did not build.
    assert sum("waiting for it" in line for line in said) <= 2
    assert json.loads((target / "studio_tiny.json").read_text())["version"] >= 1
    assert not target.with_name("tiny-llama.building").exists()


def test_a_stale_or_half_build_is_rebuilt(tmp_path: Path) -> None:
    from studio.engine.tiny import build_tiny_model

    target = tmp_path / "tiny-llama"
    target.mkdir()
    (target / "studio_tiny.json").write_text("{not json")  # an interrupted write
    built = build_tiny_model(target, pretrain_steps=2)
    assert (built / "config.json").exists() and (built / "tokenizer.json").exists()
