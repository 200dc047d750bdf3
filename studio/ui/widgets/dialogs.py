"""Modal dialogs: pick a path (typed, or from a file tree)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, Static


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
