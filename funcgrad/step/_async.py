"""``fg.make_step(compile="async")``: the step runs eagerly while its compiled form is
built in a background thread (:class:`Background`); across ranks, every rank switches
at the same step."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _compat
from ..core._base import Params, State
from ..core._flat import leaves
from ..core._tree import tree_map
from ..model._errors import explain_compile_failure
from ..model._model import shadowing


def _world_size() -> int:
    import torch.distributed as dist  # torch imports it anyway

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


Run = Callable[..., tuple[Any, ...]]
"""``run(fresh, params, state, *batch)``: one step once the checks passed (``fresh``:
the inputs' structure is new, see :class:`funcgrad.step._checks.Checks`)."""


BUILDING, READY, FAILED = 0, 1, -1
"""A rank's build, as :meth:`Background._agreed` sends it (the minimum over ranks)."""


class Background:
    """``compile="async"``: the step runs eagerly (the same math, donation and
    all-or-nothing guarantees as ``compile=False``) while the compiled step is built
    in a background thread; the first call after it is ready runs compiled. The
    switch falls between two calls: no step is lost, repeated or half-applied. A
    build that fails leaves the step eager, with one warning that explains the error.

    In one process the build calls the compiled step once on copies of the first
    call's inputs (any ``torch.compile`` backend; the copies' step is thrown away).
    Across ``torch.distributed`` ranks that would send the copies' collectives beside
    the eager steps', so the build compiles without running
    (:func:`funcgrad._compat.compile_without_running`, inductor and AOT-autograd
    backends), and the ranks agree on every eager step, by one all-reduce of a flag,
    when all of them are ready: every rank switches at the same step, and a
    collective never pairs an eager rank with a compiled one. A build that fails on
    any rank keeps every rank eager."""

    def __init__(
        self,
        compiled: Run,
        eager: Run,
        core: Any,
        options: dict[str, Any],
        traced: Callable[[], Callable[..., Any]],
        held: Callable[[Callable[..., Any]], Run],
    ) -> None:
        # core: the step's _step._Core; traced(): its traceable step; held(impl): impl
        # as a Run with Ctrl-C held (both from funcgrad/step/_step.py)
        self.compiled, self.eager, self.core, self.options = compiled, eager, core, options
        self.traced, self.held = traced, held
        self.thread: threading.Thread | None = None
        self.built = False  # this rank's build is done
        self.ready = False  # the step runs compiled from now on (every rank's build is done)
        self.error: BaseException | None = None
        self.gave_up = False  # a build failed (on any rank): eager from now on
        self.ranks = 1
        self.is_compiled = False

    def _start(self, params: Params, state: State, args: tuple[Any, ...]) -> None:
        self.ranks = _world_size()
        copies = tree_map(
            lambda t: t.detach().clone() if isinstance(t, Tensor) else t, (params, state, args)
        )

        def build() -> None:
            try:
                with self.core.scope():
                    self._build(copies)
            except BaseException as err:  # reported on the calling thread, once
                self.error = err
            else:
                self.built = True

        self.thread = threading.Thread(target=build, name="funcgrad-compile", daemon=True)
        self.thread.start()

    def _build(self, copies: tuple[Any, Any, tuple[Any, ...]]) -> None:
        if self.ranks > 1:
            self.compiled = self._without_running(copies)
        else:
            self.compiled(True, copies[0], copies[1], *copies[2])

    def _without_running(self, copies: tuple[Any, Any, tuple[Any, ...]]) -> Run:
        """The compiled step, built without running it; arguments that do not fit it
        (another batch shape) go to the usual compiled step, which compiles for them
        as ``compile=True`` does (on every rank alike, when the shapes change alike)."""
        built = _compat.compile_without_running(
            self.traced(), dict(self.options), (copies[0], copies[1], *copies[2])
        )
        run_built, usual = self.held(built), self.compiled

        def run(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
            if built.guard_check(params, state, *args):
                return run_built(fresh, params, state, *args)
            return usual(fresh, params, state, *args)

        return run

    def _state(self) -> int:
        return FAILED if self.error is not None else READY if self.built else BUILDING

    def _agreed(self, device: torch.device) -> int:
        """Across ranks: every rank's build state, all-reduced (the minimum): ready
        everywhere, failed somewhere, or still building. Every rank acts on the same
        answer, at the same call."""
        import torch.distributed as dist

        flag = torch.tensor([self._state()], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return int(flag.item())

    def _warn(self, params: Params, state: State, args: tuple[Any, ...]) -> None:
        err = self.error
        if err is None:
            reason = "it failed on another rank (that rank's warning names the error)"
        else:
            if isinstance(err, Exception):
                # The explanation re-runs the step eagerly to find the user's own error;
                # not across ranks, where that step's collectives would pair with the
                # other ranks' next step.
                rerun = lambda: self.core.pure_step(params, state, *args)  # noqa: E731
                skip = lambda: None  # noqa: E731
                better = explain_compile_failure(
                    err, rerun if self.ranks == 1 else skip, 'compile="async"'
                )
                err = better if better is not None else err
            reason = f"the error: {type(err).__name__}: {err}"
        warnings.warn(
            'fg.make_step(compile="async"): the compiled step could not be built, so the '
            f"step goes on eagerly (the same results, slower); {reason}",
            RuntimeWarning,
            stacklevel=4,
        )

    def __call__(self, fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        if self.thread is None:
            self._start(params, state, args)
        if not (self.ready or self.gave_up):
            if self.ranks > 1:
                now = self._agreed(next(iter(leaves(params))).device)
            else:
                now = self._state()
            self.ready, self.gave_up = now == READY, now == FAILED
            if self.gave_up:
                self._warn(params, state, args)
        self.is_compiled = self.ready
        if self.ready:
            return self.compiled(fresh, params, state, *args)
        # (torch's own "compiling" flag, one for the process, is set while the other
        # thread traces: funcgrad asks _compat.compiling(), which is per thread)
        building = self.thread is not None and self.thread.is_alive()
        with shadowing() if building else contextlib.nullcontext():
            return self.eager(fresh, params, state, *args)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this process's background build ends (or ``timeout`` seconds);
        whether it built the compiled step. Across ranks the step switches once every
        rank's build is done (the next call after that)."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.built


__all__ = ["BUILDING", "FAILED", "READY", "Background", "Run"]
