"""The screen's frame timer: a keypress is painted in the next frame, not two frames later.

Textual paints a screen from a repeating timer capped at ``TEXTUAL_FPS`` (60) frames a second, paused
while nothing needs drawing. Its timer keeps a fixed grid of ticks; when a tick comes later than its
slot (the timer sat paused through it), the next one is placed one to two periods ahead. A running
training run draws a few times a second, so the timer was often in that long sleep when a key
arrived, and the frame showing the key waited 17-33 ms with the event loop idle (the events
benchmark's slowest keypresses, traced tick by tick). :class:`FrameTimer` keeps the cap but measures it
from the last frame: resumed when a frame is due, it ticks at once.
"""

from __future__ import annotations

from asyncio import sleep
from time import monotonic

from textual.timer import EventTargetGone, Timer


class FrameTimer(Timer):
    """A repeating timer that ticks as soon as it is resumed, unless its last tick was under one
    interval ago; then it ticks when the interval is up."""

    async def _run(self) -> None:
        interval = self._interval
        last = monotonic() - interval
        while True:
            await self._active.wait()  # paused: nothing to draw
            wait = last + interval - monotonic()
            if wait > 0:
                await sleep(wait)
                continue  # (it may have been paused meanwhile)
            last = monotonic()
            try:
                await self._tick(next_timer=last, count=0)
            except EventTargetGone:
                break
