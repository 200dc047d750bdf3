"""What the tests share besides fixtures (those are tests/conftest.py's): importable as ``helpers``
(pyproject's pytest ``pythonpath`` puts tests/ on the path; a worker process a test starts gets
tests/ on its PYTHONPATH for the stand-ins it builds, e.g. ``helpers.worker_fakes:FakeTrainer``).

- ``cli``: the one way a test runs the `studio` command in a fresh process;
- ``engine``: the tiny model's run config, the engine pinned to the CPU;
- ``ui``: the real app driven with the worker played from recorded events;
- ``worker_fakes``, ``oom_injection``, ``disk_fill``: stand-ins and faults for the worker's engine;
- ``tiny_families``, ``tool_templates``, ``go_template``, ``gguf_reading``: tiny models of each family,
  chat templates, Ollama's Go templates and llama.cpp's GGUF reading, as the tests need them.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""The tests/ folder."""
REPO = TESTS.parent
"""The checkout's root."""
DATA = TESTS / "data"
"""Pinned inputs the tests read (recorded events, the GPU's measurements)."""
