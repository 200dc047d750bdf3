"""A TextArea for prompt templates that colours the ``{field}`` placeholders.

Known fields, the response field and unknown fields each get their own colour (component classes
styled with theme variables in app.tcss), so a typo in a field name shows while typing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.style import Style
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import TextArea

from studio.core.prompt import placeholder_spans


class TemplateEditor(TextArea):
    """Edits a template; ``{field}`` placeholders are highlighted by kind."""

    COMPONENT_CLASSES = TextArea.COMPONENT_CLASSES | {
        "template-editor--field",
        "template-editor--response",
        "template-editor--unknown",
    }

    def __init__(self, text: str = "", **kwargs: Any) -> None:
        super().__init__(text, soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.known_fields: set[str] | None = None
        """Fields the data provides; None while no dataset is open (nothing is marked unknown)."""
        self.response_field = "output"

    def set_fields(self, known: Iterable[str] | None, response_field: str) -> None:
        """Which fields exist (for the unknown-field colour) and which one is the response."""
        self.known_fields = set(known) if known is not None else None
        self.response_field = response_field
        self._build_highlight_map()
        self.refresh()

    def _build_highlight_map(self) -> None:
        super()._build_highlight_map()
        highlights = self._highlights
        # Highlights are byte offsets within a line (tree-sitter's convention).
        for row, line in enumerate(self.document.lines):
            if "{" not in line:
                continue
            for span in placeholder_spans(line):
                if span.field == self.response_field:
                    kind = "response"
                elif self.known_fields is not None and span.field not in self.known_fields:
                    kind = "unknown"
                else:
                    kind = "field"
                start = len(line[: span.start].encode("utf-8"))
                end = len(line[: span.end].encode("utf-8"))
                highlights[row].append((start, end, kind))

    def render_lines(self, crop: Region) -> list[Strip]:
        # The TextArea's theme object is rebuilt on theme changes; give it the field styles each time.
        theme = self._theme
        if theme is not None:
            theme.syntax_styles = {
                "field": self._style("template-editor--field"),
                "response": self._style("template-editor--response"),
                "unknown": self._style("template-editor--unknown"),
            }
        return super().render_lines(crop)

    def _style(self, component: str) -> Style:
        style = self.get_component_rich_style(component, partial=True)
        return style
