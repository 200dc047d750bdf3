"""The layering the architecture promises: core/, ui/ and cli/ never load torch (the TUI paints fast);
no import circle inside studio/; modules short enough to read."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

HEAVY = ("torch", "transformers", "peft", "bitsandbytes")


def test_importing_every_core_ui_and_cli_module_loads_no_torch():
    # studio.cli.__main__ would run the CLI; the MCP server needs the optional mcp package.
    skip = {"studio.cli.__main__"} | (set() if importlib.util.find_spec("mcp") else {"studio.cli.mcp_server"})
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        import studio.core, studio.ui, studio.cli
        names = []
        for package in (studio.core, studio.ui, studio.cli):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if info.name in {sorted(skip)!r}:
                    continue
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


STUDIO = Path(__file__).resolve().parents[1] / "studio"


def _module_name(path: Path, root: Path) -> str:
    """``root/core/config/__init__.py`` -> ``studio.core.config`` (``root`` is the studio/ folder)."""
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in it (a function's deferred import
    too), except under ``if TYPE_CHECKING:``; ``from package import name`` is the submodule when
    there is one."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for statement in block.body for node in ast.walk(statement)}
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {m for alias in node.names if (m := known(alias.name))}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *filter(None, [base])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if (m := sub if sub in modules else known(base)) is not None:
                    found.add(m)
    return found - {name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other round (strongly connected components, Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(graph[name]):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while (member := stack.pop()) != name:
                component.append(member)
            if component:
                circles.append(sorted([name, *component]))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return circles


def test_no_import_circle_inside_studio():
    """No module of studio/ imports one that imports it back, directly or through others; a deferred
    import inside a function counts (a circle hidden in a function is still a circle)."""
    paths = {_module_name(p, STUDIO): p for p in STUDIO.rglob("*.py")}
    graph = {name: _imports(path, STUDIO, set(paths)) for name, path in paths.items()}
    assert sum(map(len, graph.values())) > 300  # the walk really read the imports
    circles = _circles(graph)
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_a_circle_through_a_deferred_import(tmp_path):
    root = tmp_path / "studio"
    root.mkdir()
    (root / "a.py").write_text("from studio import b\n")
    (root / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import studio.c\n\n\n"
                               "def f():\n    from studio.a import x\n")
    (root / "c.py").write_text("import studio.a\n")
    modules = {_module_name(p, root) for p in root.glob("*.py")}
    graph = {_module_name(p, root): _imports(p, root, modules) for p in root.glob("*.py")}
    assert graph == {"studio.a": {"studio.b"}, "studio.b": {"studio.a"}, "studio.c": {"studio.a"}}
    assert _circles(graph) == [["studio.a", "studio.b"]]


MAX_LINES = 700
EXPLAINED_LINES = 500


def test_modules_stay_short_or_say_why():
    """No module of studio/ is over 700 lines, and one over 500 says why in its docstring ("Past ~N
    lines on purpose: ..." / "Longer than ~N lines ...")."""
    too_long, unexplained = [], []
    for path in sorted(STUDIO.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        name = str(path.relative_to(STUDIO.parent))
        if lines > MAX_LINES:
            too_long.append(f"{name}: {lines}")
        elif lines > EXPLAINED_LINES and not re.search(r"(Past|Longer than) ~?\d+ lines",
                                                        ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{name}: {lines}")
    assert too_long == [], f"modules over {MAX_LINES} lines: split them by concept"
    assert unexplained == [], f"modules over {EXPLAINED_LINES} lines without a reason in their docstring"
