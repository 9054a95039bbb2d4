"""Training steps: gradients, transformation and update as one pure function.

``make_step`` builds ``step(params, state, *batch) -> (params, state, loss)``: it
checks its arguments, then dispatches to one of three step builders and wraps what it
returns in the one step function that runs the checks and explains errors.

What the builders share (:func:`_core`, and the checks in ``make_step``):

- :class:`funcgrad.step._checks.Checks`: everything that needs Python (names, structure,
  batch arity, donation safety) runs before tracing, so the traced step is pure
  tensor code;
- :func:`_gradients`: ``torch.func.grad`` of the loss, or per-sample gradients
  (built from the same vmapped function as ``fg.per_sample_grads``, in
  ``_per_sample.py``);
- ``compute``: ``tx.update`` + ``apply_updates``, a pure function.

The builders: :func:`_eager_step` (``compile=False``): with ``donate=True``,
:func:`funcgrad.core._tree.commit` writes every result into the given tensors afterwards,
in one multi-tensor copy; :func:`_compiled_step` (``compile=True``): the graph writes
them itself, each write made to depend on every gradient (:func:`_after_gradients`),
with Ctrl-C held back while the graph runs; :func:`_gradients_step`
(``compile="gradients"``): the gradient function compiled (a graph that writes
nothing), the rest as in the eager step.

So a step whose forward or backward raises (eagerly: anything in the step) changes
nothing, an interrupted step is applied whole or not at all, and params and state are
never left half-updated. What the compiled step does not cover: an exception raised
*inside* a custom transformation at run time, after writes began (funcgrad's own
transformations have no run-time failure); a two-phase write for that would cost a
second pass over everything (docs/compile-notes.md, "Figures behind the code").
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor
from torch.func import grad_and_value

from .. import _compat
from ..core._base import (
    GradientTransformation,
    LossFn,
    Params,
    State,
    apply_updates,
    require_transformation,
    updates_as_params,
)
from ..core._compose import transform_active
from ..core._flat import Flat, leaves
from ..core._scratch import Scratch, lending
from ..core._tree import commit, copy_into, sigint_held, tree_map
from . import _scalars
from ._checks import Checks, compile_scope
from ._errors import PER_SAMPLE_BATCHNORM, explain_buffer_write, explain_compile_failure, reraise
from ._ghost import ghost_gradients, hooked
from ._handle import Step
from ._minimize import minimize_step
from ._model import shadowing, watching_buffers
from ._per_sample import vmapped_grads


def _ghost_of(per_sample: GradientTransformation | None) -> Any:
    """``fg.ghost_clip``'s arguments where ``per_sample`` is one, else None."""
    return per_sample.facts.ghost if isinstance(per_sample, GradientTransformation) else None


def _gradients(
    loss_fn: LossFn, has_aux: bool, per_sample: GradientTransformation | None, buffers: bool
) -> Callable[..., tuple[Params, Tensor, Any, Any]]:
    """``fn(params, [buffers,] *batch) -> (grads, loss, new_buffers, aux)`` (traced).

    With ``buffers``, the loss sees clones of the buffers made inside the transform:
    a forward that updates them in place (train-mode BatchNorm) writes to tensors
    that ``torch.func.grad`` owns, and the updated clones leave as an auxiliary
    output. The given buffers are never written here (donation copies them later).
    """
    if buffers:

        def with_buffers(params: Params, bufs: dict[str, Tensor], *batch: Any) -> Any:
            local = {k: b.clone() for k, b in bufs.items()}
            out = loss_fn(params, local, *batch)
            # torch.func's aux holds tensors only: no None placeholder without has_aux.
            return (out[0], (local, out[1])) if has_aux else (out, local)

        def stateful(params: Params, bufs: dict[str, Tensor], *batch: Any) -> Any:
            grads, (loss, extra) = grad_and_value(with_buffers, has_aux=True)(params, bufs, *batch)
            new_bufs, aux = extra if has_aux else (extra, None)
            return grads, loss, new_bufs, aux

        return stateful
    if per_sample is None:

        def plain(params: Params, *batch: Any) -> tuple[Params, Tensor, Any, Any]:
            grads, out = grad_and_value(loss_fn, has_aux=has_aux)(params, *batch)
            loss, aux = out if has_aux else (out, None)
            return grads, loss, None, aux

        return plain
    how = _ghost_of(per_sample)
    if how is not None:  # fg.ghost_clip: from per-sample norms, no per-sample gradients
        return ghost_gradients(loss_fn, has_aux, *how)
    batched = vmapped_grads(loss_fn, has_aux, each=per_sample)

    def averaged(params: Params, *batch: Any) -> tuple[Params, Tensor, Any, Any]:
        g, losses, aux = batched(params, *batch)
        return {k: v.mean(0) for k, v in g.items()}, losses.mean(), None, aux

    return averaged


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, Tensor) else x


def _autograd_gradients(
    loss_fn: LossFn, has_aux: bool, buffers: bool
) -> Callable[..., tuple[Params, Tensor, Any, Any]]:
    """The same as :func:`_gradients` (without ``per_sample``), by plain autograd.

    Eagerly, ``torch.func.grad`` wraps every tensor and pytree on each call, which
    costs about twice the time of ``torch.autograd.grad`` over the same ``fg.call``
    (docs/compile-notes.md; the same values, bit for bit: it runs the same autograd
    engine). The eager step uses this once the first call
    with the inputs' structure has run through ``torch.func`` (whose checks give the
    clear errors: output not a scalar, aux, a write to a captured tensor). Writes to
    a module's own buffers are caught on both paths: the eager step runs under
    :func:`funcgrad.step._model.watching_buffers`, where ``fg.call`` compares the buffers'
    version counters.
    """

    def plain(params: Params, *args: Any) -> tuple[Params, Tensor, Any, Any]:
        with torch.enable_grad():
            leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
            if buffers:
                local = {k: b.clone() for k, b in args[0].items()}
                out = loss_fn(leaves, local, *args[1:])
            else:
                out = loss_fn(leaves, *args)
            loss = out[0] if has_aux else out
            if loss.requires_grad:
                g = torch.autograd.grad(loss, tuple(leaves.values()), materialize_grads=True)
            else:  # a loss that does not depend on the parameters: zeros, as torch.func
                g = tuple(torch.zeros_like(p) for p in leaves.values())
        grads = dict(zip(leaves, g, strict=True))
        new_bufs = {k: b.detach() for k, b in local.items()} if buffers else None
        aux = optree.tree_map(_detached, out[1], none_is_leaf=True) if has_aux else None
        return grads, loss.detach(), new_bufs, aux

    return plain


def _after_gradients(grads: Params, old: Any, new: Any) -> Any:
    """``new``, made to depend on every gradient, so it is written only after them.

    Inside one compiled graph inductor may schedule a write of a donated input that
    does not depend on the gradients (Adam's step counter) before the forward and
    backward ran; if they then failed, the step had half-applied itself. Selecting
    with a flag that is always False but computed from every gradient orders all
    writes after the backward. The select fuses into the update kernels, which read
    the old values anyway.
    """
    probes = [g.reshape(-1)[:1].to(torch.float32) for g in _probed(grads) if g.numel()]
    if not probes:
        return new
    probe = torch.cat(probes)
    never = (probe != probe).all() & (probe == probe).all()  # NaN and not NaN: False
    return tree_map(lambda o, n: torch.where(never, o, n), old, new)


FEW_PROBED = 16
"""A buffer of at most this many entries is probed per name by :func:`_after_gradients`
when the step kept its per-name gradients; a larger one through its flat gradient."""


def _probed(grads: Params) -> list[Tensor]:
    """The tensors whose computation the writes wait for: every gradient, or for flat
    gradients one per buffer, except that a buffer of few entries whose per-name
    gradients the step kept (:meth:`funcgrad.Flat._packed_from`) is probed through
    those: its flat gradient may be dead code (the rules read the per-name ones), and
    a probe of it would keep it. Through the flat gradient a buffer is one probe,
    which keeps a deep stack's compile short (one per name cost about 2 CPU s of 31 at
    40 layers: docs/compile-notes.md)."""
    if not isinstance(grads, Flat):
        return leaves(grads)
    out: list[Tensor] = []
    for b, buf in enumerate(grads.buffers):
        few = len(grads.layout.names_in(b)) <= FEW_PROBED
        parts = grads._parts_in(b, 0, buf.shape[-1]) if few else None
        out.extend(parts.values() if parts is not None else [buf])
    return out


class _Core(NamedTuple):
    """What the three step builders share: the gradient function (traced), the pure
    step's pieces, and the options that decide how results are written."""

    gradients: Callable[..., tuple[Params, Tensor, Any, Any]]
    compute: Callable[..., Any]
    pure_step: Callable[..., tuple[Any, ...]]
    donate: bool
    buffers: bool
    per_sample: bool
    # Around every call of the step and its background build: fg.ghost_clip's hook in
    # torch's table for the call (_ghost.hooked), else nothing.
    scope: Callable[[], contextlib.AbstractContextManager[Any]]


def _core(
    loss_fn: LossFn,
    tx: GradientTransformation,
    has_aux: bool,
    per_sample: GradientTransformation | None,
    donate: bool,
    buffers: bool,
) -> _Core:
    gradients = _gradients(loss_fn, has_aux, per_sample, buffers)

    def compute(
        grad_fn: Callable[..., Any],
        params: Params,
        state: State,
        *args: Any,
        apply: bool = True,
        record: bool = True,
    ) -> Any:
        """``(new params, state[, buffers]), grads, (loss[, aux])``; with ``apply=False``
        the updates in place of the new params. ``record=False`` (the eager step, where
        nothing differentiates through the update) runs ``tx`` without autograd, so its
        fast paths need not look for tensors that require grad (funcgrad/core/_compose.py)."""
        flat = params if isinstance(params, Flat) else None
        # Flat params (fg.params(model)): the loss sees per-name views, and the
        # per-name gradients are gathered into the flat layout in one cat per buffer.
        named, loss, new_bufs, aux = grad_fn(params if flat is None else flat.views(), *args)
        grads: Any = named if flat is None else Flat._packed_from(named, flat.layout)
        with contextlib.nullcontext() if record else torch.no_grad():
            updates, new_state = tx.update(grads, state, params)
            new: tuple[Any, ...] = (
                apply_updates(params, updates) if apply else updates,
                new_state,
            )
        new += (new_bufs,) if buffers else ()
        return new, grads, (loss.detach(),) + ((aux,) if has_aux else ())

    def pure_step(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        new, _, rest = compute(gradients, params, state, *args)
        return new + rest

    scope = hooked if _ghost_of(per_sample) is not None else contextlib.nullcontext
    return _Core(gradients, compute, pure_step, donate, buffers, per_sample is not None, scope)


def _given(core: _Core, params: Params, state: State, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The tensors a donated step writes into: params, state (and buffers)."""
    return (params, state, args[0]) if core.buffers else (params, state)


Run = Callable[..., tuple[Any, ...]]
"""``run(fresh, params, state, *batch)``: one step once the checks passed (``fresh``:
the inputs' structure is new, see :class:`funcgrad.step._checks.Checks`)."""


def _traced_step(core: _Core) -> Callable[..., tuple[Any, ...]]:
    """What ``compile=True`` hands to ``torch.compile``: the pure step, or donated, the
    step whose graph writes into the given tensors itself (inductor fuses the writes
    into the update kernels: no second pass, no new buffers)."""
    if not core.donate:
        return core.pure_step

    def donated_step(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        new, grads, rest = core.compute(core.gradients, params, state, *args)
        given = _given(core, params, state, args)
        copy_into(given, _after_gradients(grads, given, new))
        return given + rest

    return donated_step


def _held(core: _Core, impl: Callable[..., tuple[Any, ...]]) -> Run:
    """``impl`` as a :data:`Run`; donated, with Ctrl-C held back while it runs (it
    cannot land between two of the graph's kernels)."""

    def run(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        if not core.donate:
            return impl(params, state, *args)
        with sigint_held():
            return impl(params, state, *args)

    return run


def _compiled_step(core: _Core, options: dict[str, Any]) -> Run:
    """``compile=True``: the whole step as one graph (the state's 0-d float64 CPU
    tensors passed as 1-element views: funcgrad/step/_scalars.py)."""
    traced = _scalars.lowered(_traced_step(core), core.donate)
    return _scalars.Lifted(
        _held(core, torch.compile(traced, **{**options, "fullgraph": True})), core.donate
    )


def _world_size() -> int:
    import torch.distributed as dist  # torch imports it anyway

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


BUILDING, READY, FAILED = 0, 1, -1
"""A rank's build, as :meth:`_Background._agreed` sends it (the minimum over ranks)."""


class _Background:
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

    def __init__(self, compiled: Run, eager: Run, core: _Core, options: dict[str, Any]) -> None:
        self.compiled, self.eager, self.core, self.options = compiled, eager, core, options
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
            _traced_step(self.core), dict(self.options), (copies[0], copies[1], *copies[2])
        )
        run_built, usual = _held(self.core, built), self.compiled

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


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.scratch = Scratch()


def _eager_step(
    core: _Core,
    gradients: Callable[..., Any],
    fast: Callable[..., Any] | None = None,
) -> Run:
    """The step run eagerly around ``gradients`` (``fast`` instead once the inputs'
    structure went through it). Donated, the results are committed into the given
    tensors afterwards in one multi-tensor pass; large CPU results are kept for the
    next step (funcgrad/core/_scratch.py), one scratch per thread."""
    per_thread = _PerThread()

    def run(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        with sigint_held():  # once for the step: fg.call's and commit's hold nothing more
            return step(fresh, params, state, *args)

    def step(fresh: bool, params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        scratch = per_thread.scratch
        grad_fn = gradients if fresh or fast is None else fast
        try:
            lend = lending(scratch) if core.donate else contextlib.nullcontext()
            with watching_buffers(), lend:
                # Donated, the first result is the updates (added to the params at commit).
                new, _, rest = core.compute(
                    grad_fn, params, state, *args, apply=not core.donate, record=False
                )
        except Exception:
            scratch.forget()
            raise
        out = new + rest
        if not core.donate:
            return out
        given = _given(core, params, state, args)
        added = updates_as_params(params, out[0])
        commit(given[1:], out[1 : len(given)], add_to=leaves(params), add=added)
        scratch.reclaim()
        return given + out[len(given) :]

    return run


def _gradients_step(core: _Core, options: dict[str, Any]) -> Run:
    """``compile="gradients"``: the forward and backward as one graph, which writes
    nothing; the rest is the eager step."""
    compiled = torch.compile(core.gradients, **{**options, "fullgraph": True})

    def gradients(params: Params, *args: Any) -> tuple[Params, Tensor, Any, Any]:
        try:
            return compiled(params, *args)
        except Exception as err:
            eager = lambda: core.gradients(params, *args)  # noqa: E731
            reraise(err, explain_compile_failure(err, eager, 'compile="gradients"'))

    return _eager_step(core, gradients)


def make_step(
    loss_fn: LossFn,
    tx: GradientTransformation,
    *,
    has_aux: bool = False,
    compile: bool | str | dict[str, Any] = False,
    donate: bool = False,
    per_sample: GradientTransformation | None = None,
    buffers: bool = False,
) -> Step:
    """Build ``step(params, state, *batch) -> (params, state, loss)``.

    One step computes ``grads = torch.func.grad(loss_fn)(params, *batch)``, then
    ``updates, state = tx.update(grads, state, params)`` and
    ``params = fg.apply_updates(params, updates)``. The step is a callable object:
    ``step.is_compiled`` says whether its last call ran compiled, and
    ``step.wait_compiled(timeout=None)`` waits for a ``compile="async"`` build (else
    it says whether the step is compiled).

    Args:
        loss_fn: ``loss_fn(params, *batch) -> scalar`` (``(scalar, aux)`` with
            ``has_aux``; ``loss_fn(params, buffers, *batch)`` with ``buffers``).
        tx: the transformation, e.g. ``fg.chain(fg.per_group(rule, groups), fg.adam())``.
        has_aux: the step returns ``aux`` last.
        compile: wrap the step in ``torch.compile(fullgraph=True)``; a dict adds
            other ``torch.compile`` options, e.g. ``{"backend": "aot_eager"}``.
            ``"gradients"`` (or ``{"scope": "gradients", ...}``) compiles only the
            gradient computation (forward and backward, one graph that writes
            nothing) and runs ``tx`` and the update eagerly, as
            ``torch.compile(model)`` with a ``torch.optim`` optimizer does: the
            first call compiles about as fast as the model alone, and every step
            runs the update as the eager step does (docs/compile-notes.md has the
            measured trade-off). ``"async"`` (or ``{"scope": "async", ...}``):
            the call returns after an eager step, and steps run eagerly (the same
            math and guarantees) while the whole step compiles in a background
            thread; the first call after the build is done runs compiled. The
            step's ``is_compiled`` says which path the last call took;
            ``step.wait_compiled(timeout)`` blocks until the build ends. A build
            that fails warns once and the step stays eager. Across
            ``torch.distributed`` ranks every rank switches at the same step
            (they agree by one small all-reduce per eager step; the build
            compiles without running, so inductor or an AOT-autograd backend).
            A step with random ops (dropout) is not reproduced draw for draw
            while the build runs: torch's trace saves and restores the global
            generator (docs/compile-notes.md). On a CPU the build shares the
            interpreter with the eager steps (the GIL) and takes longer than
            ``compile=True``'s (docs/compile-notes.md, "compile='async'").
            ``"step"`` is the same as ``True``. With inductor,
            float16/bfloat16 results are rounded where eager rounds them
            (``emulate_precision_casts``, unless the options set it), so the compiled
            update equals the eager one bit for bit (docs/compile-notes.md).
        donate: write the new params, state (and buffers) into the given tensors in
            place and return those same tensors, so ``fg.params(model)`` and
            ``fg.buffers(model)`` keep the module live.
        per_sample: a stateless transformation (e.g. ``fg.per_group(rule, groups)``)
            applied to every sample's gradients under ``vmap`` before they are
            averaged and handed to ``tx``. The loss is then the mean of the
            per-sample losses.
        buffers: for models that update buffers in forward (train-mode BatchNorm's
            running statistics): the step is ``step(params, state, buffers, *batch)
            -> (params, state, buffers, loss)`` and ``loss_fn(params, buffers,
            *batch)`` passes them on with ``fg.call(model, params, x,
            buffers=buffers)``. The buffers come out as an eager train-mode forward
            leaves them; they are inputs and outputs of the pure step, so it stays
            one graph.

    Under a ``torch.func`` transform (``vmap`` over an ensemble's stacked params,
    ``grad`` through training steps for meta-learning) the step runs its pure math
    eagerly, whatever ``compile`` says, and cannot be donated. To compile such a
    loop, compile the transformed function written from ``tx.update`` and
    ``fg.apply_updates`` (``examples/ensemble.py``, ``examples/maml_sine.py``).

    Examples:
        >>> import torch, funcgrad as fg
        >>> model = torch.nn.Linear(2, 1)
        >>> loss = lambda p, x, y: ((fg.call(model, p, x) - y) ** 2).mean()
        >>> tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)),
        ...               fg.adam(lr=1e-2))
        >>> params = fg.params(model)
        >>> state = tx.init(params)
        >>> step = fg.make_step(loss, tx, donate=True)
        >>> params, state, l = step(params, state, torch.randn(4, 2), torch.randn(4, 1))
        >>> int(state.inner_states[1].count), params["weight"].data_ptr() == model.weight.data_ptr()
        (1, True)

        Only the forward and backward compiled (inductor), ``tx`` eager; options for
        ``torch.compile`` go in a dict with ``"scope"``:

        >>> step = fg.make_step(loss, tx, compile="gradients", donate=True)
        >>> step = fg.make_step(
        ...     loss, tx, compile={"scope": "gradients", "backend": "aot_eager"}, donate=True
        ... )

        With train-mode BatchNorm:

        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        >>> bn_loss = lambda p, b, x: fg.call(net, p, x, buffers=b).square().mean()
        >>> step = fg.make_step(bn_loss, fg.adam(), buffers=True, donate=True)
        >>> p, b = fg.params(net), fg.buffers(net)
        >>> p, s, b, l = step(p, fg.adam().init(p), b, torch.randn(4, 2))
        >>> int(net[1].num_batches_tracked)
        1
    """
    require_transformation(tx, "fg.make_step: tx")
    if per_sample is not None:
        require_transformation(
            per_sample, "fg.make_step: per_sample", "fg.ghost_clip(1.0), stateless"
        )
    if per_sample is not None and buffers:
        raise ValueError(
            "fg.make_step: per_sample= and buffers=True do not go together. A model that "
            f"updates buffers in forward is usually train-mode BatchNorm: "
            f"{PER_SAMPLE_BATCHNORM}"
        )
    if tx.facts.minimize is not None:  # fg.lbfgs: it evaluates the loss itself
        return minimize_step(
            loss_fn, tx, has_aux=has_aux, compile=compile, donate=donate,
            per_sample=per_sample, buffers=buffers,
        )  # fmt: skip
    scope, options = compile_scope(compile)
    core = _core(loss_fn, tx, has_aux, per_sample, donate, buffers)
    background: _Background | None = None
    if scope == "step":
        run: Run = _compiled_step(core, options)
    elif scope == "gradients":
        run = _gradients_step(core, options)
    else:
        # After a call with these inputs' structure went through torch.func (its checks
        # give the clear errors): plain autograd, the same values, faster.
        fast = _autograd_gradients(loss_fn, has_aux, buffers) if per_sample is None else None
        run = _eager_step(core, core.gradients, fast)
        if scope == "async":
            run = background = _Background(_compiled_step(core, options), run, core, options)
    checks = Checks(loss_fn, tx, per_sample, donate, buffers)
    compiled = scope == "step"
    pure_buffers = buffers and not donate and scope in ("step", "gradients", "async")

    def scoped(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        with core.scope():
            return call(params, state, *args)

    step = Step(scoped)

    def call(params: Params, state: State, *args: Any) -> tuple[Any, ...]:
        if isinstance(params, Flat):
            params.check_attached("fg.make_step")
        if transform_active():
            # Under torch.func.grad/vmap (meta-learning, ensembles): the pure step's
            # math, eagerly; no fast path (plain autograd, scratch buffers), no write.
            if donate:
                raise ValueError(
                    "fg.make_step(donate=True): the step runs under a torch.func "
                    "transform (grad, vmap, ...), where its results are the transform's "
                    "outputs and cannot be written into the given tensors. Build the "
                    "step with donate=False and use what it returns."
                )
            checks(params, state, args)
            return core.pure_step(params, state, *args)
        fresh = checks(params, state, args)
        if pure_buffers and isinstance(args[0], Mapping):
            # Not donated: the given buffers are not written, and a compiled step sees
            # the same aliasing on every call (the first call's fg.buffers(model) are
            # the module's own tensors, later calls' the step's outputs: dynamo guards
            # on that, and would compile the step twice). A copy of the buffers only.
            args = (
                {k: v.clone() if isinstance(v, Tensor) else v for k, v in args[0].items()},
                *args[1:],
            )
        try:
            out = run(fresh, params, state, *args)
        except Exception as err:
            better: Exception | None = explain_buffer_write(err, per_sample=core.per_sample)
            if better is None and (compiled or (background is not None and background.ready)):
                better = explain_compile_failure(err, lambda: core.pure_step(params, state, *args))
            reraise(err, better)
        step.is_compiled = compiled or (background is not None and background.is_compiled)
        return out

    if background is not None:
        step._wait = background.wait
    return step
