"""What ``fg.make_step`` returns: the step, callable, with what it says about itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class StepResultAux(NamedTuple):
    """The result with ``has_aux=True``: ``(params, state, loss, aux)``."""

    params: Any
    state: Any
    loss: Any
    aux: Any


class StepResultBuffers(NamedTuple):
    """The result with ``buffers=True``: ``(params, state, buffers, loss)``."""

    params: Any
    state: Any
    buffers: Any
    loss: Any


class StepResultBuffersAux(NamedTuple):
    """The result with ``buffers=True`` and ``has_aux=True``:
    ``(params, state, buffers, loss, aux)``."""

    params: Any
    state: Any
    buffers: Any
    loss: Any
    aux: Any


def result_type(buffers: bool, has_aux: bool) -> type[tuple[Any, ...]] | None:
    """The NamedTuple a step built with these options returns; None: a plain
    ``(params, state, loss)`` tuple (three parts need no names)."""
    if buffers:
        return StepResultBuffersAux if has_aux else StepResultBuffers
    return StepResultAux if has_aux else None


class Step:
    """``step(params, state, *batch)``, as :func:`funcgrad.make_step` builds it.

    ``is_compiled``: whether the last call ran the compiled step (``compile="async"``:
    False until the background build is done; ``compile=True``: True from the first
    call). ``wait_compiled(timeout=None)``: with ``compile="async"``, block until this
    process's build ends (or ``timeout`` seconds) and say whether it built the
    compiled step; otherwise nothing is being built, and it says whether the step is
    compiled.

    A call returns ``(params, state, loss)``, a plain tuple; with ``buffers=True``
    (``buffers`` after ``state``) or ``has_aux=True`` (``aux`` last) a NamedTuple
    (:func:`result_type`): unpack it as a tuple or read its fields (``out.loss``).
    """

    __slots__ = ("_call", "_result", "_wait", "is_compiled")

    def __init__(
        self,
        call: Callable[..., tuple[Any, ...]],
        is_compiled: bool = False,
        result: type[tuple[Any, ...]] | None = None,
    ) -> None:
        self._call = call
        self._result = result
        self._wait: Callable[[float | None], bool] | None = None
        self.is_compiled = is_compiled

    def __call__(self, params: Any, state: Any, *batch: Any) -> tuple[Any, ...]:
        out = self._call(params, state, *batch)
        return out if self._result is None else self._result(*out)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """See the class docstring."""
        return self.is_compiled if self._wait is None else self._wait(timeout)

    def __repr__(self) -> str:
        return f"<fg.make_step step, is_compiled={self.is_compiled}>"
