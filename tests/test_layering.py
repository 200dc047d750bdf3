"""The layering the architecture promises: core/ and ui/ never load torch (the TUI paints fast)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("torch", "transformers", "peft", "bitsandbytes")


def test_importing_every_core_and_ui_module_loads_no_torch():
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        import studio.core, studio.ui, studio.cli
        names = []
        for package in (studio.core, studio.ui):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(info.name)
                names.append(info.name)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(len(names), heavy)
        assert not heavy, heavy
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    count = int(proc.stdout.split()[0])
    assert count >= 10  # the walk really found the modules


def test_engine_is_the_only_layer_importing_torch_by_name():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "studio"
    offenders = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.split(".")[0] in HEAVY]
    assert offenders == []
