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
   costs less; convolutions through ``unfold``; embeddings over equal indices;
   normalization layers from their normalized input; any other module through a
   ``vmap`` over its own parameters only);
4. the clip factors ``c_i = min(1, C / (norm_i + 1e-6))`` (``core._base.clip_factor``,
   ``fg.rules.clip_norm``'s), and
   the gradients ``sum_i c_i g_i / B`` from the same ``a`` and ``b`` (book-keeping: no
   second backward).

A parameter reached by two calls (tied weights, a module applied twice) gets its
per-sample gradients formed from each call and summed before the norm, as the
per-sample gradient of the whole loss has it.

The shape probe (the ``z``'s shapes) is a forward on meta tensors, cached per input
signature; traced by ``torch.compile`` it is a forward whose results are unused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad

from .. import _compat
from .._compat import compiling, tree_flatten, tree_unflatten
from ..core._base import LossFn, Params, clip_factor
from ._errors import PER_SAMPLE_BATCHNORM
from ._ghost_layers import (
    Call,
    adopt_read_directly,
    broadcast_lead,
    float_leaves,
    layer_of,
    module_path,
    report_fallbacks,
)

Shapes = list[list[tuple[tuple[int, ...], torch.dtype]]]
"""The tapped modules' floating output shapes and dtypes, one list per call, in order."""


class _Tap(threading.local):
    """The pass in progress in this thread: ``None`` (the hook does nothing), ``"probe"``
    (record output shapes) or ``"tap"`` (add the ``z``'s, record inputs)."""

    def __init__(self) -> None:
        # Every field set on the instance in each thread (not class defaults): dynamo
        # guards on what the instance's __dict__ holds, which must not change in a step.
        self.mode: str | None = None
        self.named: Sequence[tuple[str, Tensor]] = ()
        self.shapes: Shapes | None = None
        self.owners: list[str] = []  # the probe's calls: each module's path
        self.zs: Sequence[Tensor] = ()
        self.used = 0
        self.calls: list[Call] | None = None
        self.shared: Sequence[bool] = ()
        self.batch = 0


_TAP = _Tap()


class _Installed:
    """The global forward hook :func:`_hook`, in torch's table only while some thread
    runs a ghost step (a count of the steps in progress, under a lock), under the same
    key every time (``_compat.GlobalForwardHook``: dynamo guards on the table)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.hook: _compat.GlobalForwardHook | None = None

    def __enter__(self) -> None:
        with self.lock:
            if self.hook is None:
                self.hook = _compat.GlobalForwardHook(_hook)
            if self.count == 0:
                self.hook.add()
            self.count += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.count -= 1
            if self.count == 0 and self.hook is not None:
                self.hook.remove()


_INSTALLED = _Installed()


def hooked() -> _Installed:
    """The context in which ghost steps run: the tap's global forward hook is in
    torch's table from the first entry (in any thread) to the last exit. ``fg.make_step``
    enters it around each call of a ghost step and around its background build, where
    the compiled step is traced; a ghost gradient function called eagerly enters it
    itself."""
    return _INSTALLED


def _trained(module: nn.Module) -> dict[str, str]:
    """The module's own parameters that are trained: own name -> name in the params."""
    out: dict[str, str] = {}
    for own, p in module._parameters.items():
        if p is None:
            continue
        for name, t in _TAP.named:
            if t is p:
                out[own] = name
                break
    return out


def _hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    mode = _TAP.mode
    if mode is None:
        return None
    names = _trained(module)
    if not names:
        return None
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        raise RuntimeError(f"fg.ghost_clip: {PER_SAMPLE_BATCHNORM}")
    leaves, spec = float_leaves(output)
    slots = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
    if mode == "probe":
        assert _TAP.shapes is not None
        index = len(_TAP.shapes)
        _TAP.shapes.append([(tuple(leaves[i].shape), leaves[i].dtype) for i in slots])
        _TAP.owners.append(module_path(names))
        if index < len(_TAP.shared) and _TAP.shared[index]:  # as the tap pass will: batched
            new = list(leaves)
            lead = broadcast_lead([tuple(leaves[i].shape) for i in slots])
            for i in slots:
                shape = leaves[i].shape[1:] if lead else leaves[i].shape
                new[i] = leaves[i].expand(_TAP.batch, *shape)
            return tree_unflatten(new, spec)
        return None
    assert _TAP.calls is not None
    shared = _TAP.shared[len(_TAP.calls)]
    new = list(leaves)
    for i in slots:  # a call without the batch (shared by the samples) gets it here
        new[i] = leaves[i] + _TAP.zs[_TAP.used]
        _TAP.used += 1
    call = Call(module, names, args, kwargs, len(slots))
    call.shared = shared
    call.state = {  # a module in _RULES may still need it: see layer_of
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    _TAP.calls.append(call)
    return tree_unflatten(new, spec)


class _Passing:
    """Set the thread's pass for the block; always reset after it."""

    def __init__(self, mode: str, named: Sequence[tuple[str, Tensor]], batch: int) -> None:
        self.mode, self.named, self.batch = mode, named, batch

    def __enter__(self) -> _Tap:
        if _TAP.mode is not None:
            raise RuntimeError(
                "fg.ghost_clip: a ghost-clipped step ran inside another one's loss "
                "(nested make_step calls with per_sample=fg.ghost_clip); call them one "
                "after the other."
            )
        _TAP.mode, _TAP.named, _TAP.batch, _TAP.used = self.mode, self.named, self.batch, 0
        return _TAP

    def __exit__(self, *exc: object) -> None:
        _TAP.mode, _TAP.named, _TAP.shapes, _TAP.zs, _TAP.calls = None, (), None, (), None
        _TAP.used, _TAP.shared = 0, ()


def _signature(params: Params, batch: tuple[Any, ...]) -> Any:
    def sig(t: Any) -> Any:
        if isinstance(t, Tensor):
            return (tuple(t.shape), t.dtype, t.device)
        return type(t)

    return (tuple((k, sig(v)) for k, v in params.items()), tuple(sig(b) for b in batch))


Plan = list[tuple[list[tuple[tuple[int, ...], torch.dtype]], bool]]
"""Per tapped call: its floating outputs' shapes and dtypes in the step's batch, and
whether the call is shared by the samples (no batch dimension: its ``z``'s get one)."""


def _pass_shapes(
    loss_fn: LossFn,
    params: Params,
    batch: tuple[Any, ...],
    n: int,
    rows: int,
    meta: bool,
    shared: Sequence[bool],
) -> Shapes:
    """One probe pass with the batch tensors at ``rows`` rows: the tapped outputs' shapes."""

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
    with _Passing("probe", list(p.items()), rows) as tap, torch.no_grad():
        tap.shapes, tap.shared, tap.owners = [], shared, []
        loss_fn(p, *(resized(b) for b in batch))
        return tap.shapes


def _plan(at_n: Shapes, at_more: Shapes, n: int) -> Plan:
    """Which calls are batched (their leading dimension follows the rows) and which are
    shared (no dimension does); anything else is an error."""
    plan: Plan = []
    if len(at_n) != len(at_more):
        raise RuntimeError(
            "fg.ghost_clip: the loss called a different number of modules with trained "
            f"parameters at {n} and {n + 1} samples ({len(at_n)} and {len(at_more)}): "
            "it must call the same modules whatever the batch size."
        )
    for one, more in zip(at_n, at_more, strict=True):
        shared = [a == b for (a, _), (b, _) in zip(one, more, strict=True)]
        batched = [
            len(a) > 0 and a[0] == n and b[0] == n + 1 and a[1:] == b[1:]
            for (a, _), (b, _) in zip(one, more, strict=True)
        ]
        if not (all(shared) or all(batched)):
            bad = [a for (a, _), ok in zip(one, batched, strict=True) if not ok]
            raise ValueError(
                f"fg.ghost_clip: a module with trained parameters returned a tensor of "
                f"shape {bad[0]} whose leading dimension is not the batch ({n}). Ghost "
                "clipping needs every module with trained parameters to keep the batch "
                "first (batch_first=True for RNNs and attention), or to run without it "
                "(a positional embedding on arange); use "
                "per_sample=fg.clip_by_global_norm(max_norm) otherwise."
            )
        plan.append((one, all(shared) and bool(one)))
    return plan


def _probe(
    loss_fn: LossFn, params: Params, batch: tuple[Any, ...], n: int, cache: dict[Any, Plan]
) -> Plan:
    """What the tap pass will tap, in call order, found by two probe passes at ``n`` and
    ``n + 1`` rows: a dimension that follows the rows is the batch. Eagerly on meta
    tensors, cached in ``cache`` (one per ghost step) by the inputs' signature; traced,
    forwards whose results are unused."""
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
    settled: list[bool] = []
    owners: list[str] = []
    for _ in range(1 + 4096):
        try:
            at_n, at_more = (
                _pass_shapes(loss_fn, params, batch, n, r, meta, settled) for r in (n, n + 1)
            )
        except (NotImplementedError, RuntimeError) as err:  # an op without a meta kernel
            if meta:
                meta = False
                continue
            _refuse_prepended(err, plan, settled, owners)
            raise
        owners = list(_TAP.owners)
        plan = _plan(at_n, at_more, n)
        now = [sh for _, sh in plan]
        later = [i for i in range(len(settled), len(now)) if now[i]]
        if not later:
            break
        settled = now[: later[0] + 1]
    if key is not None:
        if len(cache) > 64:  # shapes that keep changing: keep the cache small
            cache.clear()
        cache[key] = plan
    return plan


def _refuse_prepended(
    err: BaseException, plan: Plan, settled: list[bool], owners: list[str]
) -> None:
    """The forward failed once a shared call's output got the batch in front (a call
    without the batch whose output has no leading 1, such as T5's relative position
    bias on a ``(T, T)`` grid, then permuted): funcgrad's error, naming the module,
    not the model's own from deep inside it."""
    for i, on in enumerate(settled):
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


def ghost_gradients(
    loss_fn: LossFn, has_aux: bool, max_norm: float, reduction: str
) -> Callable[..., tuple[Params, Tensor, Any, Any]]:
    """``fn(params, *batch) -> (grads, loss, None, aux)``: the mean over the batch of
    each sample's gradient clipped to ``max_norm`` (see the module docstring); ``loss``
    the mean of the samples' losses; ``aux`` the batch's loss_fn's."""
    cache: dict[Any, Plan] = {}
    told: set[str] = set()  # the fallbacks already reported by this step

    def fn(params: Params, *batch: Any) -> tuple[Params, Tensor, Any, Any]:
        if compiling():  # traced: the step's caller put the hook in (hooked())
            return ghostly(params, *batch)
        with _INSTALLED:
            return ghostly(params, *batch)

    def ghostly(params: Params, *batch: Any) -> tuple[Params, Tensor, Any, Any]:
        n = next(b.shape[0] for b in batch if isinstance(b, Tensor) and b.dim() > 0)
        shapes = _probe(loss_fn, params, batch, n, cache)
        if not shapes:
            raise ValueError(
                "fg.ghost_clip: no module with trained parameters ran in the loss: "
                f"ghost clipping sees parameters through the modules that own them "
                f"(fg.call(model, params, ...)); got {sorted(params)}. Use "
                "per_sample=fg.clip_by_global_norm(max_norm) for this loss."
            )
        first = next(iter(params.values()))
        lead = [sh and broadcast_lead([s for s, _ in leaves]) for leaves, sh in shapes]
        zs = [
            torch.zeros(
                (n, *s[1:]) if lead[c] else (n, *s) if shared else s, dtype=dt, device=first.device
            )
            for c, (leaves, shared) in enumerate(shapes)
            for s, dt in leaves
        ]
        calls: list[Call] = []

        def tapped(zs: list[Tensor]) -> Any:
            with _Passing("tap", list(params.items()), n) as tap:
                tap.zs, tap.calls, tap.shared = zs, calls, [sh for _, sh in shapes]
                out = loss_fn(params, *batch)
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
            for c in calls:
                pair: Any = (c.args, c.kwargs)
                c.leaves, c.spec = tree_flatten(pair)
                seen += [t for t in c.leaves if isinstance(t, Tensor)]
            return loss, ((loss, seen, out[1]) if has_aux else (loss, seen))

        gz, kept = grad(tapped, has_aux=True)(zs)
        loss, seen = kept[0], iter(kept[1])
        aux = kept[2] if has_aux else None
        # The output gradients of the batch's loss: a mean loss's are the samples'
        # divided by n, folded into the norms (scale^2) and weights (scale) below.
        scale = float(n) if reduction == "mean" else 1.0
        it = iter(gz)
        for c, lead_c in zip(calls, lead, strict=True):
            leaves = [next(seen) if isinstance(t, Tensor) else t for t in c.leaves]
            c.args, c.kwargs = tree_unflatten(leaves, c.spec)
            c.grads = [next(it) for _ in range(c.n_out)]
            if lead_c:  # (B, T, d) -> (B, 1, T, d): each sample's gradient of (1, T, d)
                c.grads = [g.unsqueeze(1) for g in c.grads]
        adopt_read_directly(calls, params)
        layers = [layer_of(c, n) for c in calls]
        if not compiling():
            report_fallbacks(layers, params, told)
        reached: dict[str, int] = {}
        for c in calls:
            for name in c.names.values():
                reached[name] = reached.get(name, 0) + 1
        missing = sorted(set(params) - set(reached))
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
        # A call that shares a parameter with another: its per-sample gradients, summed
        # over the calls before the norm.
        shared: dict[str, Tensor] = {}
        alone = []
        for layer in layers:
            if any(reached[k] > 1 for k in layer.call.names.values()):
                for k, g in layer.per_sample().items():
                    shared[k] = shared[k] + g if k in shared else g
            else:
                alone.append(layer)
                for v in layer.norms2().values():
                    norms2 = norms2 + v.to(norms2.dtype)
        for g in shared.values():
            norms2 = norms2 + g.flatten(1).square().sum(1).to(norms2.dtype)
        coef = clip_factor(max_norm, (norms2 * scale**2).sqrt())
        w = coef * (scale / n)
        grads: dict[str, Tensor] = {}
        for layer in alone:
            grads.update(layer.weighted(w.to(layer.call.grads[0].dtype)))
        for k, g in shared.items():
            grads[k] = torch.tensordot(w.to(g.dtype), g, dims=1)
        out = {k: grads[k].to(p.dtype).reshape(p.shape) for k, p in params.items()}
        mean_loss = loss.detach() if reduction == "mean" else loss.detach() / n
        return out, mean_loss, None, aux

    return fn
