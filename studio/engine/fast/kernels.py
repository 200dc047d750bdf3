"""What Studio's own Triton kernel modules (dequant.py, update.py, norm.py) share: the kernels jitted
on first use, for Triton's interpreter or its compiler, and given up on for the process once they fail."""

from __future__ import annotations

import importlib
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _in_scope(fn: types.FunctionType, scope: dict) -> types.FunctionType:
    """``fn`` looking its global names up in ``scope`` instead of its module."""
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__annotations__ = fn.__annotations__  # the ``tl.constexpr`` parameters Triton reads
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class OwnKernels:
    """The Triton kernels ``names`` of ``studio.engine.fast.<module>`` (a module that imports Triton,
    so nothing imports it until a kernel runs), and whether they work on this machine."""

    def __init__(self, module: str, names: tuple[str, ...], what: str, fallback: str,
                 per_batch: tuple[str, ...] = (), helpers: tuple[str, ...] = ()):
        self.module, self.names = module, names
        self.helpers = helpers
        """Functions of the module that its kernels call by name (Triton inlines them). Each way of
        running needs its own jitted copies, so the kernels are jitted from copies of their functions
        that look names up in a copy of the module's namespace where these are the jitted ones."""
        self.per_batch = per_batch
        """Integer parameters whose value changes with the batch (a row count): Triton compiles no
        case of its own for them (by default it compiles one for a value that is a multiple of 16,
        and one for 1, the first time a run meets each: a compile in the middle of a run)."""
        self.what, self.fallback = what, fallback
        self._broken: dict[bool, str] = {}
        """Why the kernels failed, by whether the interpreter ran them: a failure of one says nothing
        of the other (an older Triton's interpreter may lack what its compiler has)."""
        self._jitted: dict[bool, dict | None] = {}

    @property
    def broken(self) -> str:
        """Why the kernels failed here, as the environment now runs them ('' while they work): the
        engine then takes ``fallback``."""
        return self._broken.get(interpreted(), "")

    def get(self) -> dict | None:
        """The kernels by name, jitted for the interpreter or the compiler as the environment says
        now (Triton decides when it wraps a function: one jitted under the other setting would run
        the interpreter, which truncates to bf16, on GPU tensors), or None without Triton."""
        key = interpreted()
        if key not in self._jitted:
            self._jitted[key] = self._jit()
        return self._jitted[key]

    def _jit(self) -> dict | None:
        try:
            import triton

            module = importlib.import_module(f"studio.engine.fast.{self.module}")
        except Exception:  # noqa: BLE001 - any import failure (no Triton, a broken one) means "not here"
            return None
        scope = dict(vars(module))
        for name in self.helpers:
            scope[name] = triton.jit(_in_scope(getattr(module, name), scope))
        out = {}
        for name in self.names:
            fn = _in_scope(getattr(module, name), scope)
            params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
            per_batch = [p for p in self.per_batch if p in params]
            out[name] = triton.jit(fn, do_not_specialize=per_batch) if per_batch else triton.jit(fn)
        return out

    def mark_broken(self, exc: BaseException) -> None:
        """Give up on the kernels for this process after ``exc`` (a Triton that cannot compile them
        for this GPU, say), with one warning saying why and what the engine does instead."""
        if not self.broken:
            self._broken[interpreted()] = f"{type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"Studio's {self.what} failed ({self.broken}); {self.fallback}", RuntimeWarning,
                          stacklevel=3)

    def attempt(self, run: Callable[[], Any]) -> tuple[bool, Any]:
        """``run()`` (which calls these kernels): (True, its result), or (False, None) when the
        kernels failed here, now or before; a failure gives them up for this process
        (:meth:`mark_broken`) and the caller takes its other way. Inside a CUDA graph's capture a
        failure is raised: the capture fails and the step runs eagerly, where this is asked again."""
        if self.broken:
            return False, None
        try:
            return True, run()
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build here: the caller's other way
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            self.mark_broken(exc)
            return False, None

    def usable(self, device: torch.device) -> bool:
        """Whether the kernels can run on ``device``: CUDA with Triton, or anywhere under the interpreter."""
        if self.broken or (device.type != "cuda" and not interpreted()):
            return False
        return self.get() is not None
