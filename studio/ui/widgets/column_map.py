"""Map template fields to dataset columns when the names differ (``data.columns`` in the config)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Label, Select, Static


class FieldSelect(Select[str]):
    """A column picker that knows which template field it fills."""

    def __init__(self, field_name: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.field_name = field_name


class ColumnMap(VerticalScroll):
    """One Select a template field; picking a column posts :class:`ColumnMap.Changed`."""

    class Changed(Message):
        """The mapping changed: template field -> column, only for fields named differently."""

        def __init__(self, mapping: dict[str, str]) -> None:
            super().__init__()
            self.mapping = mapping

    def compose(self) -> ComposeResult:
        yield Static("Which column fills each {field} of the template.", id="map-note")

    def show(self, fields: list[str], optional: set[str], columns: list[str], mapping: dict[str, str]) -> None:
        """Rebuild the rows for ``fields``; a field maps to its own name unless ``mapping`` says
        otherwise."""
        self._showing = True
        for row in self.query(".map-row"):
            row.remove()
        rows = []
        missing = []
        for name in fields:
            column = mapping.get(name, name)
            value = column if column in columns else Select.NULL
            if value is Select.NULL and name not in optional:
                missing.append(name)
            select = FieldSelect(name, [(c, c) for c in columns], value=value, allow_blank=True,
                                 prompt="(none)" if name in optional else "⚠ pick a column",
                                 classes="map-select", compact=True)
            rows.append(Horizontal(Label(f"{{{name}}}", classes="map-field"), select, classes="map-row"))
        self.mount_all(rows)
        note = "Which column fills each {field} of the template."
        if missing:
            note += f"\n⚠ no column for {', '.join('{' + m + '}' for m in missing)}: pick one below."
        self.query_one("#map-note", Static).update(note)
        self.call_after_refresh(self._done_showing)

    def _done_showing(self) -> None:
        self._showing = False

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        if getattr(self, "_showing", False):
            return  # values set while rebuilding are not edits
        mapping: dict[str, str] = {}
        for select in self.query(".map-select").results(FieldSelect):
            name = select.field_name
            if isinstance(select.value, str) and select.value != name:
                mapping[name] = select.value
        self.post_message(self.Changed(mapping))
