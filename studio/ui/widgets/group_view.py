"""The group view: one GRPO step's sampled group, its completions best first with each reward's score.

It follows the newest group as the run logs them (one a logged step, GrpoGroupSampled), or stays on
an older one while a person browses back through the run's history (the training pane's ``[`` and
``]``; ``]`` past the newest follows again). Each row: the completion's total reward, each reward's
score (``-`` where it did not apply), its advantage within the group, its length in tokens (``✂``:
cut at the length limit) and its text on one line.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from studio.core import events as ev
from studio.core.runs.cells import cell

TEXT_WIDTH = 80
"""Characters of a completion shown in its row (the whole text is in the run's events.jsonl)."""


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def ranked(group: ev.GrpoGroupSampled) -> list[dict]:
    """The group's completions, the highest total first (ties keep the sampling order)."""
    return sorted(group.completions, key=lambda c: -float(c.get("total", 0.0)))


class GroupView(Vertical):
    """A table of one sampled group, live or browsed back (:meth:`older`, :meth:`newer`)."""

    DEFAULT_CSS = """
    GroupView { height: 14; }
    GroupView #group-title { height: 1; color: $text-muted; }
    GroupView #group-prompt { height: 1; }
    GroupView DataTable { height: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.position: int | None = None
        """Which logged group is shown (an index into the run's groups); None: the newest, following."""
        self._groups: list[ev.GrpoGroupSampled] = []
        self._shown: tuple[int, int, str] | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="group-title")
        yield Static("", id="group-prompt")
        yield DataTable(id="group-table", cursor_type="row", zebra_stripes=True)

    @property
    def shown(self) -> ev.GrpoGroupSampled | None:
        """The group on screen, or None before the run logged any."""
        if not self._groups:
            return None
        index = len(self._groups) - 1 if self.position is None else min(self.position, len(self._groups) - 1)
        return self._groups[index]

    def show(self, groups: list[ev.GrpoGroupSampled]) -> None:
        """The run's groups so far (oldest first); the view repaints when what it shows changed."""
        self._groups = groups
        if self.position is not None and self.position >= len(groups):
            self.position = None
        self._paint()

    def older(self) -> None:
        """Show the group logged before the one shown."""
        if not self._groups:
            return
        current = len(self._groups) - 1 if self.position is None else self.position
        self.position = max(0, current - 1)
        self._paint()

    def newer(self) -> None:
        """Show the group logged after the one shown; at the newest, follow the run again."""
        if self.position is None:
            return
        self.position += 1
        if self.position >= len(self._groups) - 1:
            self.position = None
        self._paint()

    def _paint(self) -> None:
        group = self.shown
        following = self.position is None
        key = (id(group), len(self._groups), "live" if following else "browse")
        if key == self._shown:
            return
        self._shown = key
        title = self.query_one("#group-title", Static)
        table = self.query_one("#group-table", DataTable)
        if group is None:
            title.update("sampled group: none yet (one is shown per logged step)")
            self.query_one("#group-prompt", Static).update("")
            table.clear(columns=True)
            return
        index = self._groups.index(group) + 1
        where = ("the newest, following the run; [ for older" if following else
                 f"{index} of {len(self._groups)}; [ older, ] newer")
        title.update(f"sampled group at step {group.step} ({where})")
        self.query_one("#group-prompt", Static).update(f"prompt: {cell(group.prompt, 200)}")
        completions = ranked(group)
        labels = list(completions[0].get("scores", {})) if completions else []
        table.clear(columns=True)
        table.add_columns("total", *labels, "adv", "tokens", "completion")
        for completion in completions:
            scores = completion.get("scores", {})
            tokens = f"{completion.get('tokens', 0)}{'' if completion.get('stopped', True) else ' ✂'}"
            table.add_row(f"{float(completion.get('total', 0.0)):.3f}", *(_number(scores.get(n)) for n in labels),
                          f"{float(completion.get('advantage', 0.0)):+.2f}", tokens,
                          cell(completion.get("text", ""), TEXT_WIDTH))
