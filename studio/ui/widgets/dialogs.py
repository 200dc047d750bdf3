"""Modal dialogs: pick a path (typed, or from a file tree), answer yes or no, choose how to export a run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, Static

if TYPE_CHECKING:
    from studio.core.runs import RunDir


class FilteredTree(DirectoryTree):
    """A directory tree showing folders and files with the given suffixes only (hidden ones left out)."""

    def __init__(self, path: str | Path, suffixes: Iterable[str] | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.suffixes = {s.lower() for s in suffixes} if suffixes else None

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        shown = []
        for path in paths:
            if path.name.startswith("."):
                continue
            if self.suffixes is None or path.is_dir() or path.suffix.lower() in self.suffixes:
                shown.append(path)
        return shown


class PathDialog(ModalScreen[Path | None]):
    """Ask for a path: type it, or pick it in the tree. Dismisses with the Path or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="dialog.cancel")]

    def __init__(self, title: str, initial: str = "", *, must_exist: bool = True,
                 suffixes: Iterable[str] | None = None, folders: bool = False, tree: bool = True) -> None:
        """``must_exist`` refuses paths that are not there; ``suffixes`` filter the tree;
        ``folders`` lets a folder be picked (saved datasets are folders)."""
        super().__init__()
        self.title_text = title
        self.initial = initial
        self.must_exist = must_exist
        self.suffixes = list(suffixes) if suffixes else None
        self.folders = folders
        self.show_tree = tree

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, id="dialog-title")
            start = Path(self.initial).expanduser()
            root = start if start.is_dir() else start.parent if start.parent.is_dir() else Path.cwd()
            if self.show_tree:
                yield FilteredTree(root, self.suffixes, id="dialog-tree")
            yield Input(self.initial, placeholder="a path: type it, or pick it above",
                        id="dialog-path")
            yield Static("", id="dialog-error")
            with Horizontal(id="dialog-buttons"):
                yield Button("OK", variant="primary", id="dialog-ok")
                yield Button("Cancel", id="dialog-cancel")

    def on_mount(self) -> None:
        self.query_one("#dialog-path", Input).focus()

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        self.query_one("#dialog-path", Input).value = str(event.path)
        self._submit(event.path)

    def on_directory_tree_directory_selected(self, event: DirectoryTree.DirectorySelected) -> None:
        self.query_one("#dialog-path", Input).value = str(event.path)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._submit(Path(event.value.strip()).expanduser())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "dialog-ok":
            self._submit(Path(self.query_one("#dialog-path", Input).value.strip()).expanduser())
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def _submit(self, path: Path) -> None:
        error = self.query_one("#dialog-error", Static)
        if not str(path) or str(path) == ".":
            error.update("Type a path first.")
        elif self.must_exist and not path.exists():
            error.update(f"{path}: no such file or folder")
        elif path.is_dir() and not self.folders:
            error.update(f"{path} is a folder; pick a file in it")
        else:
            self.dismiss(path)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; y or Enter on the first button says yes, n or Escape says no."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical {
        width: 64; height: auto; padding: 1 2;
        border: thick $error; background: $panel;
    }
    ConfirmScreen Horizontal { height: auto; margin-top: 1; }
    ConfirmScreen Button { margin-right: 2; }
    """

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no"),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question)
            with Horizontal():
                yield Button(f"{self.yes} (y)", variant="error", id="confirm-yes")
                yield Button(f"{self.no} (n)", id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "confirm-yes")

    def action_answer(self, answer: bool) -> None:
        """Close with ``answer``."""
        self.dismiss(answer)


class ExportScreen(ModalScreen[tuple[str, str] | None]):
    """Where to export, and how: a copy of the adapter, or the base model with the adapter merged."""

    DEFAULT_CSS = """
    ExportScreen { align: center middle; }
    ExportScreen > Vertical {
        width: 96; height: auto; padding: 1 2;
        border: round $primary; background: $panel;
    }
    ExportScreen Horizontal { height: auto; margin-top: 1; }
    ExportScreen Button { margin-right: 1; }
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="export.cancel")]

    def __init__(self, run: RunDir) -> None:
        super().__init__()
        self.run = run

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Export run {self.run.id}")
            yield Static("Folder to write (created; must not exist yet):")
            yield Input(str(self.run.path / "export"), id="export-path")
            with Horizontal():
                yield Button("Save adapter", variant="primary", id="export-adapter")
                yield Button("Merge into base (bf16)", id="export-merged")
                yield Button("GGUF + Modelfile", id="export-gguf")
                yield Button("Cancel", id="export-cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        path = self.query_one("#export-path", Input).value.strip()
        kind = {"export-adapter": "adapter", "export-merged": "merged",
                "export-gguf": "gguf"}.get(event.button.id or "")
        self.dismiss((kind, path) if kind and path else None)
