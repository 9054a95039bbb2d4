"""Per-sample clipping from per-sample gradient norms, without per-sample gradients.

``fg.make_step(..., per_sample=fg.ghost_clip(C))`` clips every sample's gradient to
norm ``C`` and averages, as ``per_sample=fg.clip_by_global_norm(C)`` does under
``vmap``, in one forward and one backward of the batch (ghost clipping, Li et al.
2021; book-keeping, Bu et al. 2023):

1. a forward in which every module that owns trained parameters has a zero tensor
   ``z`` added to its output (a global forward hook, in torch's table only while a
   ghost step runs: :func:`hooked`), and records its inputs;
2. one ``torch.func.grad`` with respect to the ``z``'s: each module's output gradient
   ``b``, sample by sample (the batch's loss is the mean or sum of the samples'), and
   never the parameters' gradients;
3. from each module's inputs ``a`` and ``b``, every sample's squared gradient norm
   (``_ghost_layers._Matmul``: ``|a|^2 |b|^2`` per position, or the Gram form
   ``sum((a a^T) * (b b^T))`` over a sequence, or the per-sample matrix, whichever
   costs less; convolutions through ``unfold`` or a grouped convolution backward;
   embeddings over equal indices; normalization layers from their normalized input;
   attention through a batched ``vjp`` of its core (``_ghost_attention``); any other
   module through a ``vmap`` of its own code only, the calls it makes returning what
   they returned, their inputs tapped in step 1 by a global forward pre-hook);
4. the clip factors ``c_i = min(1, C / (norm_i + 1e-6))`` (``core._base.clip_factor``,
   ``fg.rules.clip_norm``'s), and
   the gradients ``sum_i c_i g_i / B`` from the same ``a`` and ``b`` (book-keeping: no
   second backward).

A parameter reached by two calls (tied weights, a module applied twice): its
per-sample gradient is the sum of the calls', and its norm the norm of that sum
(``_ghost_sum``: from the calls' factors where their rules have them, else formed).

The shape probe (the ``z``'s shapes) is a forward on meta tensors, cached per input
signature; traced by ``torch.compile`` it is a forward whose results are unused. The
eager probe also watches every use of every trained parameter (``DirectReads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import grad

from .._compat import compiling, tree_flatten, tree_unflatten
from ..core._base import Gradients, LossFn, Params
from ._ghost_layers import Vmapped, adopt_read_directly, layer_of, report_fallbacks
from ._ghost_sum import clipped_sum
from ._ghost_tap import (
    _INSTALLED,
    IN,
    IN_FIXED,
    OUT,
    Adoption,
    Call,
    Passing,
    Shapes,
    broadcast_lead,
    hooked,
)
from ._ghost_watch import DirectReads

__all__ = ["GhostGradients", "ghost_gradients", "hooked"]


def _signature(params: Params, batch: tuple[Any, ...]) -> Any:
    def sig(t: Any) -> Any:
        if isinstance(t, Tensor):
            return (tuple(t.shape), t.dtype, t.device)
        return type(t)

    return (tuple((k, sig(v)) for k, v in params.items()), tuple(sig(b) for b in batch))


Plan = list[tuple[list[tuple[tuple[int, ...], torch.dtype]], bool, str, tuple[bool, ...]]]
"""Per tapped entry: its floating tensors' shapes and dtypes in the step's batch,
whether the call is shared by the samples (no batch dimension: its ``z``'s get one),
its kind (``OUT``: a module's outputs, ``IN``/``IN_FIXED``: a call's inputs), and per
tensor whether it is the same for every sample and led by a 1 where the batch goes
(``broadcast_lead``; in a batched call's output: T5's position bias, ``(1, H, T, T)``)."""

Settled = list[tuple[bool, tuple[bool, ...]]]
"""The probe's entries that get the batch as the tap pass will give it: shared, lead."""


def _pass_shapes(
    loss_fn: LossFn,
    params: Params,
    batch: tuple[Any, ...],
    n: int,
    rows: int,
    meta: bool,
    settled: Settled,
    adoption: Adoption,
    watch: Any = None,
) -> tuple[Shapes, list[str], list[str], set[str], list[Any]]:
    """One probe pass with the batch tensors at ``rows`` rows: the tapped entries' shapes,
    kinds and modules, the parameters their modules' calls reached, and the OUT
    entries' (module, caller). ``watch``: a :class:`DirectReads` mode to run the pass
    under (eagerly)."""

    def resized(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if meta:
            shape = (rows, *t.shape[1:]) if t.dim() and t.shape[0] == n else t.shape
            return torch.empty(shape, dtype=t.dtype, device="meta")
        if rows == n or not t.dim() or t.shape[0] != n:
            return t
        return torch.cat([t, t[: rows - n]])

    p = {k: torch.empty_like(v, device="meta") for k, v in params.items()} if meta else params
    named = list(p.items())
    with Passing("probe", named, rows, adoption) as tap, torch.no_grad():
        tap.shapes, tap.owners = [], []
        tap.plan = [(sh, le, OUT) for sh, le in settled]
        if watch is not None:
            watch.ids = {id(t): name for name, t in named}
        with contextlib.nullcontext() if watch is None else watch:
            loss_fn(p, *(resized(b) for b in batch))
        return tap.shapes, tap.kinds, tap.owners, tap.reached, tap.callers


def _plan(at_n: Shapes, at_more: Shapes, n: int, kinds: list[str]) -> Plan:
    """Which calls are batched (their leading dimension follows the rows) and which are
    shared (no dimension does); anything else is an error (for a call's outputs: the
    inputs of a call a module makes itself are either batched or not)."""
    plan: Plan = []
    if len(at_n) != len(at_more):
        raise RuntimeError(
            "fg.ghost_clip: the loss called a different number of modules with trained "
            f"parameters at {n} and {n + 1} samples ({len(at_n)} and {len(at_more)}): "
            "it must call the same modules whatever the batch size."
        )
    for one, more, kind in zip(at_n, at_more, kinds, strict=True):
        shared = [a == b for (a, _), (b, _) in zip(one, more, strict=True)]
        batched = [
            len(a) > 0 and a[0] == n and b[0] == n + 1 and a[1:] == b[1:]
            for (a, _), (b, _) in zip(one, more, strict=True)
        ]
        if kind != OUT:
            plan.append((one, False, IN if all(batched) else IN_FIXED, (False,) * len(one)))
            continue
        sizes = [a for a, _ in one]
        if one and all(shared):
            plan.append((one, True, OUT, (broadcast_lead(sizes),) * len(one)))
            continue
        lead = tuple(sh and len(a) > 0 and a[0] == 1 for sh, a in zip(shared, sizes, strict=True))
        bad = [a for a, ok, le in zip(sizes, batched, lead, strict=True) if not (ok or le)]
        if bad:
            raise ValueError(
                f"fg.ghost_clip: a module with trained parameters returned a tensor of "
                f"shape {bad[0]} whose leading dimension is not the batch ({n}). Ghost "
                "clipping needs every module with trained parameters to keep the batch "
                "first (batch_first=True for RNNs and attention), or to run without it "
                "(a positional embedding on arange); use "
                "per_sample=fg.clip_by_global_norm(max_norm) otherwise."
            )
        plan.append((one, False, OUT, lead))
    return plan


def _probe(
    loss_fn: LossFn,
    params: Params,
    batch: tuple[Any, ...],
    n: int,
    cache: dict[Any, tuple[Plan, Adoption]],
    wide: set[int],
    adoption: Adoption,
) -> tuple[Plan, Adoption]:
    """What the tap pass will tap, in call order, found by two probe passes at ``n`` and
    ``n + 1`` rows: a dimension that follows the rows is the batch. Eagerly on meta
    tensors, cached in ``cache`` (one per ghost step) by the inputs' signature; traced,
    forwards whose results are unused.

    Eagerly the first pass also watches the parameters' uses (:class:`DirectReads`): a
    parameter its module's calls reach and some other code reads too is refused (that
    share of its gradient would be missing), and a module whose parameters a call it
    makes reads goes into ``wide`` (its fallback reruns its whole subtree).

    A shared call whose output the model refuses with the batch in front (T5's relative
    position bias) goes to the module that made the call, and the probe starts over:
    the plan comes with the adoptions it was found with (``adoption``, plus those; a new
    object, so that a step's other threads keep theirs)."""
    key = None
    if not compiling():
        key = _signature(params, batch)
        hit = cache.get(key)
        if hit is not None:
            return hit
    meta = not compiling()
    plan: Plan = []
    # A shared call's output gets the batch in the tap pass, and a module it feeds then
    # sees a batched input: a call's side depends on the calls before it. Probe again
    # with the shared calls found so far batched, each time settling the calls up to
    # the next shared one (once per shared call, plus one).
    settled: Settled = []
    owners: list[str] = []
    callers: list[Any] = []
    watch = DirectReads() if key is not None else None
    reached: set[str] = set()
    for _ in range(1 + 4096):
        try:
            (at_n, kinds, named, reached, calls), (at_more, *_) = (
                _pass_shapes(
                    loss_fn,
                    params,
                    batch,
                    n,
                    r,
                    meta,
                    settled,
                    adoption,
                    watch if r == n else None,
                )
                for r in (n, n + 1)
            )
        except (NotImplementedError, RuntimeError) as err:  # an op without a meta kernel
            if meta:
                meta = False
                continue
            more = _adopt(plan, settled, callers, adoption)
            if more is not None:
                adoption, settled, meta = more, [], not compiling()
                continue
            _refuse_prepended(err, plan, settled, owners)
            raise
        owners, callers = list(named), list(calls)
        plan = _plan(at_n, at_more, n, kinds)
        now = [(sh, le) for _, sh, _, le in plan]
        later = [i for i in range(len(settled), len(now)) if now[i][0] or any(now[i][1])]
        if not later:
            break
        settled = now[: later[0] + 1]
    if watch is not None:
        watch.refuse(reached)
        wide.update(watch.within)
    if key is not None:
        if len(cache) > 64:  # shapes that keep changing: keep the cache small
            cache.clear()
        cache[key] = (plan, adoption)
    return plan, adoption


def _adopt(plan: Plan, settled: Settled, callers: list[Any], adoption: Adoption) -> Adoption | None:
    """The forward failed once the last settled call, shared, got the batch in front:
    that module given to the module that called it (:class:`Adoption`), if one did."""
    if not settled or not settled[-1][0] or any(settled[-1][1]):
        return None
    i = len(settled) - 1
    j = sum(e[2] == OUT for e in plan[:i])  # its place among the OUT entries (callers)
    if i >= len(plan) or plan[i][2] != OUT or j >= len(callers) or callers[j][1] is None:
        return None
    return adoption.plus(*callers[j])


def _refuse_prepended(err: BaseException, plan: Plan, settled: Settled, owners: list[str]) -> None:
    """The forward failed once a shared call's output got the batch in front (a call
    without the batch whose output has no leading 1, such as T5's relative position
    bias on a ``(T, T)`` grid, then permuted): funcgrad's error, naming the module,
    not the model's own from deep inside it."""
    for i, (on, _) in enumerate(settled):
        if on and i < len(plan) and i < len(owners):
            if not broadcast_lead([s for s, _ in plan[i][0]]):
                raise ValueError(
                    f"fg.ghost_clip: the module '{owners[i]}' runs without the batch (its "
                    f"output {plan[i][0][0][0]} is the same for every sample, and has no "
                    "leading dimension of 1 for the batch to take). Ghost clipping gives "
                    "each sample its own copy by putting the batch in front, which the "
                    f"model's next operations refuse ({type(err).__name__}: "
                    f"{str(err).splitlines()[0][:200]}). Use "
                    "per_sample=fg.clip_by_global_norm(max_norm) for this model (the vmap "
                    "path), or freeze that module's parameters."
                ) from err


class GhostGradients:
    """``fg.ghost_clip``'s gradient function: called as ``(params, *batch) ->
    Gradients``; :meth:`check` runs its eager probe, which a step about to be traced
    with these inputs' structure calls first (the traced probe watches no parameter
    use)."""

    def __init__(self, fn: Callable[..., Gradients], check: Callable[..., None]) -> None:
        self._fn, self.check = fn, check

    def __call__(self, params: Params, *batch: Any) -> Gradients:
        return self._fn(params, *batch)


def ghost_gradients(
    loss_fn: LossFn, has_aux: bool, max_norm: float, reduction: str
) -> GhostGradients:
    """``fn(params, *batch) -> (grads, loss, None, aux)``: the mean over the batch of
    each sample's gradient clipped to ``max_norm`` (see the module docstring); ``loss``
    the mean of the samples' losses; ``aux`` the batch's loss_fn's."""
    cache: dict[Any, tuple[Plan, Adoption]] = {}
    wide: set[int] = set()  # id(module): its fallback reruns its whole subtree (_probe)
    # Calls without the batch given to their callers (_probe): the latest found, where
    # the next probe starts (a traced one from what the eager check found).
    adopted = [Adoption()]
    told: set[str] = set()  # the fallbacks already reported by this step

    def fn(params: Params, *batch: Any) -> Gradients:
        if compiling():  # traced: the step's caller put the hook in (hooked())
            return ghostly(params, *batch)
        with _INSTALLED:
            return ghostly(params, *batch)

    def check(params: Params, *batch: Any) -> None:
        """The eager probe (shapes, and the parameters' uses), for a step about to be
        traced with these inputs' structure: the traced probe watches nothing."""
        with _INSTALLED:
            n = next(b.shape[0] for b in batch if isinstance(b, Tensor) and b.dim() > 0)
            adopted[0] = _probe(loss_fn, params, batch, n, cache, wide, adopted[0])[1]

    def ghostly(params: Params, *batch: Any) -> Gradients:
        n = next(b.shape[0] for b in batch if isinstance(b, Tensor) and b.dim() > 0)
        shapes, adoption = _probe(loss_fn, params, batch, n, cache, wide, adopted[0])
        if not compiling():
            adopted[0] = adoption
        if not shapes:
            raise ValueError(
                "fg.ghost_clip: no module with trained parameters ran in the loss: "
                f"ghost clipping sees parameters through the modules that own them "
                f"(fg.call(model, params, ...)); got {sorted(params)}. Use "
                "per_sample=fg.clip_by_global_norm(max_norm) for this loss."
            )
        first = next(iter(params.values()))
        zs = [
            torch.zeros(
                (n, *s[1:]) if le else (n, *s) if shared else s, dtype=dt, device=first.device
            )
            for leaves, shared, _, lead in shapes
            for (s, dt), le in zip(leaves, lead, strict=True)
        ]
        calls: list[Call] = []
        entries: list[Any] = []  # the Calls and the Childs, in the order of their z's

        def tapped(zs: list[Tensor]) -> Any:
            with Passing("tap", list(params.items()), n, adoption) as tap:
                tap.zs, tap.calls = zs, calls
                tap.plan = [(sh, le, kind) for _, sh, kind, le in shapes]
                out = loss_fn(params, *batch)
                entries[:] = tap.entries
                if tap.used != len(zs):
                    raise RuntimeError(
                        "fg.ghost_clip: the forward called other modules than its shape "
                        f"probe did ({tap.used} tapped outputs, {len(zs)} probed): the "
                        "loss must call the same modules in the same order on every call "
                        "with inputs of the same shapes."
                    )
            loss = out[0] if has_aux else out
            # What the modules saw leaves as torch.func's aux (tensors only, unwrapped);
            # the rest of their arguments stays with the calls.
            seen: list[Tensor] = []
            for e in entries:
                pair: Any = (e.args, e.kwargs) if isinstance(e, Call) else e.output
                e.leaves, e.spec = tree_flatten(pair)
                seen += [t for t in e.leaves if isinstance(t, Tensor)]
            return loss, ((loss, seen, out[1]) if has_aux else (loss, seen))

        gz, kept = grad(tapped, has_aux=True)(zs)
        loss, seen = kept[0], iter(kept[1])
        aux = kept[2] if has_aux else None
        # The output gradients of the batch's loss: a mean loss's are the samples'
        # divided by n, folded into the norms (scale^2) and weights (scale) below.
        scale = float(n) if reduction == "mean" else 1.0
        it = iter(gz)
        for e in entries:
            leaves = [next(seen) if isinstance(t, Tensor) else t for t in e.leaves]
            if not isinstance(e, Call):
                e.output = tree_unflatten(leaves, e.spec)
                e.in_grads = [next(it) for _ in range(e.n_in)]
                continue
            e.args, e.kwargs = tree_unflatten(leaves, e.spec)
            e.grads = [next(it) for _ in range(e.n_out)]
            # Led by a 1 that took the batch: (B, T, d) -> (B, 1, T, d), each sample's
            # gradient of the (1, T, d) output.
            e.grads = [g.unsqueeze(1) if le else g for g, le in zip(e.grads, e.lead, strict=True)]
        adopt_read_directly(calls, params)
        layers = [layer_of(c, n) for c in calls]
        for layer in layers:
            if isinstance(layer, Vmapped) and id(layer.call.module) in wide:
                layer.narrow = False
        if not compiling():
            report_fallbacks(layers, params, told)
        missing = sorted(set(params) - {name for c in calls for name in c.names.values()})
        if missing:
            raise ValueError(
                f"fg.ghost_clip: parameters {missing} are not used by any module call "
                "(read directly in the loss, or through functional ops in the forward "
                "of a module that owns no trained parameter itself). Ghost clipping sees "
                "parameters through the modules that own them; use "
                "per_sample=fg.clip_by_global_norm(max_norm) for this model."
            )
        norms2 = torch.zeros(
            n, dtype=torch.promote_types(first.dtype, torch.float32), device=first.device
        )
        grads = clipped_sum(layers, n, max_norm, scale, norms2)
        out = {k: grads[k].to(p.dtype).reshape(p.shape) for k, p in params.items()}
        mean_loss = loss.detach() if reduction == "mean" else loss.detach() / n
        return Gradients(out, mean_loss, None, aux)

    return GhostGradients(fn, check)
