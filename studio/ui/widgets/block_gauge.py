"""The block gauge: GPU memory as a grid of squares, coloured by category, against the card.

One square is 1 GB for models that need several GB (the seed's drawing); small models get 0.1 GB
squares or finer, and the caption says which. The predicted and the measured grids sit side by
side, each under the setup it is of (the card and weights predicted for, the device and weights
measured on); squares past the card's capacity turn to the theme's error colour.

Colours come from the running theme's variables ($primary, $accent, ...), so every theme works.
"""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.style import Style
from rich.text import Text
from textual.color import Color
from textual.reactive import reactive
from textual.widget import Widget

from studio.core.memory import CATEGORIES, OPTIONAL_CATEGORIES
from studio.core.memory.gpus import GB

CATEGORY_COLOURS = {
    "weights": "primary",
    "experts": "primary-lighten-3",
    "lora": "accent",
    "gradients": "warning",
    "optimizer": "secondary",
    "activations": "success",
    "overhead": "foreground-muted",
}
"""Theme variable for each category: a mixture of experts' expert weights a lighter shade of the
other frozen weights."""

_FALLBACK = {"primary": "#0178d4", "primary-lighten-3": "#5ab4ff", "accent": "#ffa62b", "warning": "#ffa62b",
             "secondary": "#004578", "success": "#4ebf71", "foreground-muted": "#808080", "error": "#ba3c5b",
             "foreground": "#e0e0e0"}
SQUARES_PER_ROW = 20
_UNITS_GB = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8, 16)
MAX_SQUARES = 240
"""At most this many squares a grid: coarser squares for bigger totals."""


def choose_unit(biggest: int, capacity: int | None) -> float:
    """Bytes per square: 1 GB when the run needs several GB (coarser when the grid would overflow),
    finer for small models so their categories stay visible."""
    if biggest >= 4 * GB:
        span = max(biggest, capacity or 0)
        for unit in _UNITS_GB:
            if unit >= 1 and span / (unit * GB) <= MAX_SQUARES:
                return unit * GB
        return _UNITS_GB[-1] * GB
    for unit in _UNITS_GB:
        if biggest / (unit * GB) <= 50:
            return unit * GB
    return GB


def unit_label(unit: float) -> str:
    """``1 GB``, ``0.1 GB``, ``10 MB``: how much one square holds."""
    gb = unit / GB
    return f"{gb:g} GB" if gb >= 0.1 else f"{gb * 1000:g} MB"


def square_categories(categories: dict[str, int], unit: float) -> list[str]:
    """The category of each square: the one that owns the middle of the square's byte range."""
    total = sum(categories.values())
    edges = []
    running = 0
    for name in CATEGORIES:
        running += categories.get(name, 0)
        edges.append((running, name))
    last = next((name for name in reversed(CATEGORIES) if categories.get(name)), CATEGORIES[0])
    squares = []
    for k in range(math.ceil(total / unit)):
        middle = (k + 0.5) * unit
        squares.append(next((name for edge, name in edges if middle < edge), last))
    return squares


class BlockGauge(Widget):
    """Predicted and measured memory as grids of squares, with a legend and the card's capacity."""

    DEFAULT_CSS = """
    BlockGauge {
        height: auto;
        width: 1fr;
        padding: 0 1;
    }
    """

    predicted: reactive[dict[str, int] | None] = reactive(None, layout=True)
    """Predicted bytes by category (None: nothing to draw)."""

    measured: reactive[dict[str, int] | None] = reactive(None, layout=True)
    """Measured bytes by category from the worker (None: not training yet)."""

    capacity: reactive[int | None] = reactive(None, layout=True)
    """The card's memory in bytes (None: no outline)."""

    capacity_name: reactive[str] = reactive("")
    """What the card is called, for the caption."""

    predicted_setup: reactive[str] = reactive("", layout=True)
    """What the prediction is for, under its title (``for L4 24 GB, NF4 weights``)."""

    measured_setup: reactive[str] = reactive("", layout=True)
    """What the measurement was taken on, under its title (``on CPU, FP32 weights``)."""

    measured_note: reactive[str] = reactive("", layout=True)
    """Why nothing is measured yet and what would measure it (lines), shown in place of the grid."""

    setup_note: reactive[str] = reactive("", layout=True)
    """Said under the caption when the two setups differ, so that their gap reads as what it is."""

    def _colour(self, variable: str) -> str:
        """The theme's colour for ``variable`` as #rrggbb (translucent ones blended on the background)."""
        try:
            variables = self.app.get_css_variables()
        except Exception:  # no app yet (rendering in isolation)
            variables = {}
        try:
            colour = Color.parse(variables.get(variable) or _FALLBACK.get(variable, "#808080"))
            if colour.a < 1:
                colour = Color.parse(variables.get("background") or "#000000") + colour
            return colour.hex6
        except Exception:  # a theme with an unparsable value: fall back rather than fail to draw
            return _FALLBACK.get(variable, "#808080")

    def _grid(self, categories: dict[str, int] | None, unit: float, title: str, setup: str,
              note: str = "") -> list[Text]:
        """The lines of one grid, each exactly SQUARES_PER_ROW * 2 cells wide: the title, what setup
        it is of, then the squares (or ``note`` when there are none)."""
        width = SQUARES_PER_ROW * 2

        def fit(text: str, style: Style | str) -> Text:
            return Text((text if len(text) <= width else text[: width - 1] + "…").ljust(width), style=style)

        dim = Style(dim=True)
        if not categories:
            return [fit(title, "bold"), *(fit(line, dim) for line in note.splitlines())]
        total = sum(categories.values())
        lines = [fit(f"{title} {total / GB:.2f} GB", "bold")]
        if setup:
            lines.append(fit(setup, dim))
        squares = square_categories(categories, unit)
        cap_squares = int(self.capacity // unit) if self.capacity and self.capacity / unit <= MAX_SQUARES else None
        count = max(len(squares), cap_squares or 0)
        error = self._colour("error")
        muted = self._colour("foreground-muted")
        row = Text()
        for k in range(count):
            if k < len(squares):
                over = cap_squares is not None and k >= cap_squares
                colour = error if over else self._colour(CATEGORY_COLOURS[squares[k]])
                row.append("■ ", style=Style(color=colour))
            else:
                row.append("□ ", style=Style(color=muted))
            if (k + 1) % SQUARES_PER_ROW == 0:
                lines.append(row)
                row = Text()
        if row.plain:
            row.pad_right(width - len(row.plain))
            lines.append(row)
        return lines

    def render(self) -> RenderableType:
        if not self.predicted and not self.measured:
            return Text("No estimate: the line above says why.", style=Style(dim=True))
        totals = [sum(c.values()) for c in (self.predicted, self.measured) if c]
        unit = choose_unit(max(totals), self.capacity)
        left = self._grid(self.predicted, unit, "Predicted", self.predicted_setup)
        right = self._grid(self.measured, unit, "Measured", self.measured_setup, self.measured_note)
        blank = Text(" " * (SQUARES_PER_ROW * 2))
        body = []
        for k in range(max(len(left), len(right))):
            line = Text()
            line.append_text(left[k] if k < len(left) else blank)
            line.append("   ")
            line.append_text(right[k] if k < len(right) else blank)
            body.append(line)
        notes = [Text(self.setup_note, style=Style(bold=True))] if self.setup_note and self.measured else []
        return Group(*body, Text(""), *self._legend(), self._caption(unit), *notes)

    def _legend(self) -> list[Text]:
        lines = []
        for name in CATEGORIES:
            if name in OPTIONAL_CATEGORIES and not any((c or {}).get(name) for c in (self.predicted, self.measured)):
                continue
            line = Text()
            line.append("■ ", style=Style(color=self._colour(CATEGORY_COLOURS[name])))
            line.append(f"{name:<12}")
            for categories in (self.predicted, self.measured):
                value = (categories or {}).get(name)
                line.append(f"{value / GB:8.2f} GB" if value is not None else f"{'-':>11}")
            lines.append(line)
        return lines

    def _caption(self, unit: float) -> Text:
        text = f"■ = {unit_label(unit)}"
        if unit < GB:
            text += " (small model: finer squares than the usual 1 GB)"
        if self.capacity:
            name = f"{self.capacity_name}, " if self.capacity_name else ""
            text += f"; card: {name}{self.capacity / GB:.1f} GB"
            if self.capacity / unit > MAX_SQUARES:
                text += f" = {self.capacity / unit:.0f} squares, off this scale"
            else:
                text += " (□ = free)"
            biggest = max(sum(c.values()) for c in (self.predicted, self.measured) if c)
            if biggest > self.capacity:
                text += "; red squares do not fit"
        return Text(text, style=Style(dim=True))
