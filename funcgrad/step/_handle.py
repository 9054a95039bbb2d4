"""What ``fg.make_step`` returns: the step, callable, with what it says about itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Step:
    """``step(params, state, *batch)``, as :func:`funcgrad.make_step` builds it.

    ``is_compiled``: whether the last call ran the compiled step (``compile="async"``:
    False until the background build is done; ``compile=True``: True from the first
    call). ``wait_compiled(timeout=None)``: with ``compile="async"``, block until this
    process's build ends (or ``timeout`` seconds) and say whether it built the
    compiled step; otherwise nothing is being built, and it says whether the step is
    compiled.
    """

    __slots__ = ("_call", "_wait", "is_compiled")

    def __init__(self, call: Callable[..., tuple[Any, ...]], is_compiled: bool = False) -> None:
        self._call = call
        self._wait: Callable[[float | None], bool] | None = None
        self.is_compiled = is_compiled

    def __call__(self, params: Any, state: Any, *batch: Any) -> tuple[Any, ...]:
        return self._call(params, state, *batch)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """See the class docstring."""
        return self.is_compiled if self._wait is None else self._wait(timeout)

    def __repr__(self) -> str:
        return f"<fg.make_step step, is_compiled={self.is_compiled}>"
