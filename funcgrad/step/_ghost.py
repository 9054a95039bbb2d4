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
   (:class:`_Linear`: ``|a|^2 |b|^2`` per position, or the Gram form
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

import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap

from .. import _compat
from .._compat import compiling, tree_flatten, tree_unflatten
from ..core._base import LossFn, Params, clip_factor
from ._errors import PER_SAMPLE_BATCHNORM

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
        self.calls: list[_Call] | None = None
        self.shared: Sequence[bool] = ()
        self.batch = 0


_TAP = _Tap()


class _Call:
    """One call of a module that owns trained parameters, recorded by the tap pass."""

    def __init__(
        self, module: nn.Module, names: dict[str, str], args: Any, kwargs: Any, n_out: int
    ) -> None:
        self.module, self.names, self.args, self.kwargs, self.n_out = (
            module, names, args, kwargs, n_out,
        )  # fmt: skip
        self.grads: list[Tensor] = []  # the output leaves' gradients, filled after the pass
        # For a module without a rule of its own (_Vmapped): the tensors its subtree ran
        # with (functional_call puts the module's own back after the pass).
        self.state: dict[str, Tensor] = {}
        self.shared = False  # called without the batch (a positional embedding on arange)
        self.leaves: list[Any] = []  # (args, kwargs) flattened, while torch.func unwraps
        self.spec: Any = None


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


def _module_path(names: dict[str, str]) -> str:
    """The module's path in the model (``""`` for the root) from its trained parameters'
    own name -> full name; the first entry is one of its own (``_trained``)."""
    own, full = next(iter(names.items()))
    return full[: len(full) - len(own)].rstrip(".")


def _broadcast_lead(shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether a shared call's outputs all lead with a dimension of 1 (a positional
    embedding on ``arange(T)[None]``: ``(1, T, d)``, added to the batch's ``(B, T, d)``).
    That dimension is where the batch broadcasts, so the batch goes there, ``(B, T, d)``,
    rather than in front of it (``(B, 1, T, d)``, which the addition would broadcast to
    ``(B, B, T, d)``); its output gradients get the 1 back (``(B, 1, T, d)``)."""
    return bool(shapes) and all(len(s) > 0 and s[0] == 1 for s in shapes)


def _float_leaves(output: Any) -> tuple[list[Any], Any]:
    """A module's output as leaves (torch's pytree, which dynamo traces) and its spec."""
    return tree_flatten(output)


def _hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    mode = _TAP.mode
    if mode is None:
        return None
    names = _trained(module)
    if not names:
        return None
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        raise RuntimeError(f"fg.ghost_clip: {PER_SAMPLE_BATCHNORM}")
    leaves, spec = _float_leaves(output)
    slots = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
    if mode == "probe":
        assert _TAP.shapes is not None
        index = len(_TAP.shapes)
        _TAP.shapes.append([(tuple(leaves[i].shape), leaves[i].dtype) for i in slots])
        _TAP.owners.append(_module_path(names))
        if index < len(_TAP.shared) and _TAP.shared[index]:  # as the tap pass will: batched
            new = list(leaves)
            lead = _broadcast_lead([tuple(leaves[i].shape) for i in slots])
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
    call = _Call(module, names, args, kwargs, len(slots))
    call.shared = shared
    call.state = {  # a module in _RULES may still need it: see _layer
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
            if not _broadcast_lead([s for s, _ in plan[i][0]]):
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


# -- per module type: norms and weighted sums from inputs a and output gradients b --


class _Layer:
    """The per-sample gradients of one call's trained parameters, from what it saw.

    ``norms2()``: each parameter's per-sample squared norm ``[B]``; ``weighted(w)``:
    ``sum_i w_i g_i``; ``per_sample()``: ``[B, *shape]`` (for parameters reached by
    several calls). Parameters are keyed by their names in ``params``."""

    def __init__(self, call: _Call, n: int) -> None:
        self.call, self.n = call, n
        self._formed: dict[str, Tensor] | None = None

    def _once(self) -> dict[str, Tensor]:
        if self._formed is None:
            self._formed = self.per_sample()
        return self._formed

    def norms2(self) -> dict[str, Tensor]:
        return {k: g.flatten(1).square().sum(1) for k, g in self._once().items()}

    def weighted(self, w: Tensor) -> dict[str, Tensor]:
        return {k: torch.tensordot(w, g, dims=1) for k, g in self._once().items()}

    def per_sample(self) -> dict[str, Tensor]:
        raise NotImplementedError


class _Matmul(_Layer):
    """``out = a @ W^T + bias`` over positions: Linear, and convolutions unfolded."""

    def __init__(
        self, call: _Call, n: int, a: Tensor, b: Tensor, shape: torch.Size, t: bool = False
    ) -> None:
        super().__init__(call, n)
        self.a, self.b, self.shape = a, b, shape  # a [B, T, in], b [B, T, out]
        self.t = t  # the weight is stored [in, out] (Hugging Face's Conv1D: a @ W + bias)
        self.g: Tensor | None = None  # the per-sample weight gradients, once formed

    def _w(self) -> str | None:
        return self.call.names.get("weight")

    def _bias(self) -> str | None:
        return self.call.names.get("bias")

    def _per_sample_weight(self) -> Tensor:
        if self.g is None:  # [B, out, in], or [B, in, out] for a weight stored that way
            a, b = self.a, self.b
            self.g = torch.bmm(a.transpose(1, 2), b) if self.t else torch.bmm(b.transpose(1, 2), a)
        return self.g

    def norms2(self) -> dict[str, Tensor]:
        a, b = self.a, self.b
        out: dict[str, Tensor] = {}
        if (w := self._w()) is not None:
            t, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
            if t == 1:  # rank one: |a|^2 |b|^2
                out[w] = a.square().sum((1, 2)) * b.square().sum((1, 2))
            elif t * (d_in + d_out) <= d_in * d_out:  # Gram form, B T^2 (in + out)
                out[w] = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(b, b.transpose(1, 2))).sum(
                    (1, 2)
                )
            else:  # the per-sample matrix, B T in out (kept for the weighted sum)
                out[w] = self._per_sample_weight().square().sum((1, 2))
        if (k := self._bias()) is not None:
            out[k] = b.sum(1).square().sum(1)
        return out

    def weighted(self, w: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if (k := self._w()) is not None:
            if self.g is not None:  # formed for the norm: B out in, not B T out in
                g = torch.tensordot(w, self.g, dims=1)
            else:
                bw = (self.b * w[:, None, None]).reshape(-1, self.b.shape[2])
                a = self.a.reshape(-1, self.a.shape[2])
                g = a.t() @ bw if self.t else bw.t() @ a
            out[k] = g.reshape(self.shape)
        if (k := self._bias()) is not None:
            out[k] = torch.tensordot(w, self.b.sum(1), dims=1)
        return out

    def per_sample(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if (k := self._w()) is not None:
            out[k] = self._per_sample_weight().reshape(self.n, *self.shape)
        if (k := self._bias()) is not None:
            out[k] = self.b.sum(1)
        return out


class _GroupedConv(_Layer):
    """A convolution's per-sample weight gradients as one grouped convolution backward
    (the samples as groups): on the CPU faster than unfolding where the unfolded rows
    are long (``Cin * kernel >= 64``), slower where they are short."""

    def __init__(self, call: _Call, n: int, x: Tensor, b: Tensor) -> None:
        super().__init__(call, n)
        self.x, self.b = x, b

    def per_sample(self) -> dict[str, Tensor]:
        m = self.call.module
        assert isinstance(m, (nn.Conv1d, nn.Conv2d))
        n, weight = self.n, self.call.state["weight"]
        x = self.x.reshape(1, n * self.x.shape[1], *self.x.shape[2:])
        go = self.b.reshape(1, n * self.b.shape[1], *self.b.shape[2:])
        wg = weight.repeat(n, *([1] * (weight.dim() - 1)))
        g = torch.ops.aten.convolution_backward(
            go, x, wg, None, list(m.stride), list(m.padding), list(m.dilation), False,
            [0] * (weight.dim() - 2), n, [False, True, False],
        )[1]  # fmt: skip
        out = {self.call.names["weight"]: g.reshape(n, *weight.shape)}
        if (k := self.call.names.get("bias")) is not None:
            out[k] = self.b.flatten(2).sum(2)
        return out


class _Embedding(_Layer):
    def __init__(self, call: _Call, n: int, idx: Tensor, b: Tensor) -> None:
        super().__init__(call, n)
        m = call.module
        assert isinstance(m, nn.Embedding)
        self.idx, self.b = idx.reshape(n, -1), b.reshape(n, -1, b.shape[-1])
        self.rows = m.num_embeddings
        if m.padding_idx is not None:  # torch gives the padding row no gradient
            self.b = self.b * (self.idx != m.padding_idx).unsqueeze(-1).to(self.b.dtype)

    def norms2(self) -> dict[str, Tensor]:
        same = (self.idx.unsqueeze(2) == self.idx.unsqueeze(1)).to(self.b.dtype)
        n2 = (same * (self.b @ self.b.transpose(1, 2))).sum((1, 2))
        return {self.call.names["weight"]: n2}

    def weighted(self, w: Tensor) -> dict[str, Tensor]:
        rows = (self.b * w[:, None, None]).reshape(-1, self.b.shape[-1])
        g = torch.zeros(self.rows, rows.shape[1], dtype=rows.dtype, device=rows.device)
        return {self.call.names["weight"]: g.index_add(0, self.idx.reshape(-1), rows)}

    def per_sample(self) -> dict[str, Tensor]:
        d = self.b.shape[-1]
        offset = torch.arange(self.n, device=self.idx.device).unsqueeze(1) * self.rows
        g = torch.zeros(self.n * self.rows, d, dtype=self.b.dtype, device=self.b.device)
        g = g.index_add(0, (self.idx + offset).reshape(-1), self.b.reshape(-1, d))
        return {self.call.names["weight"]: g.reshape(self.n, self.rows, d)}


class _Affine(_Layer):
    """Normalization layers: ``out = xhat * weight + bias``, per-sample gradients small
    (``[B, *normalized_shape]``): formed from ``xhat`` and ``b``."""

    def __init__(self, call: _Call, n: int, xhat: Tensor, b: Tensor, dims: tuple[int, ...]):
        super().__init__(call, n)
        self.xhat, self.b, self.dims = xhat, b, dims  # dims: summed over (not the batch)

    def per_sample(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if (k := self.call.names.get("weight")) is not None:
            out[k] = (self.b * self.xhat).sum(self.dims) if self.dims else self.b * self.xhat
        if (k := self.call.names.get("bias")) is not None:
            out[k] = self.b.sum(self.dims) if self.dims else self.b
        return out


class _Vmapped(_Layer):
    """Any other module: its own parameters' per-sample gradients by ``vmap`` of a
    ``vjp`` of the module alone, sample by sample (the module's children held fixed)."""

    def per_sample(self) -> dict[str, Tensor]:
        call = self.call
        own = {o: call.state[o] for o in call.names}
        rest = {k: t for k, t in call.state.items() if k not in own}
        pair: Any = (call.args, call.kwargs)
        arg_leaves: list[Any]
        arg_leaves, arg_spec = tree_flatten(pair)
        batched = [  # a shared call (no batch) runs as it was for every sample
            not call.shared and isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == self.n
            for t in arg_leaves
        ]

        def one(mp: dict[str, Tensor], cot: list[Tensor], *xs: Any) -> dict[str, Tensor]:
            it = iter(xs)
            leaves = [
                next(it).unsqueeze(0) if isb else t
                for t, isb in zip(arg_leaves, batched, strict=True)
            ]
            rebuilt: Any = tree_unflatten(leaves, arg_spec)
            args, kwargs = rebuilt

            def f(p: dict[str, Tensor]) -> list[Tensor]:
                out = functional_call(call.module, {**rest, **p}, tuple(args), kwargs)
                outs, _ = _float_leaves(out)
                return [t for t in outs if isinstance(t, Tensor) and t.is_floating_point()]

            back = vjp(f, mp)[1]
            (g,) = back([c if call.shared else c.unsqueeze(0) for c in cot])
            return g  # type: ignore[no-any-return]

        xs = [t for t, isb in zip(arg_leaves, batched, strict=True) if isb]
        in_dims = (None, 0) + (0,) * len(xs)
        g = vmap(one, in_dims=in_dims, randomness="same")(own, call.grads, *xs)
        return {call.names[o]: v for o, v in g.items()}


def _adopt_read_directly(calls: list[_Call], params: Params) -> None:
    """A trained parameter that no call of its own module reached, read directly by an
    ancestor that was called (``nn.MultiheadAttention`` reads ``out_proj.weight``
    without calling ``out_proj``): the smallest such ancestor's call takes it, and
    its per-sample gradients come from the vmap of that module (:class:`_Vmapped`)."""
    reached = {name for c in calls for name in c.names.values()}
    for name, t in params.items():
        if name in reached:
            continue
        best: tuple[int, _Call, str] | None = None
        for c in calls:
            for key, v in c.state.items():
                if v is t and (best is None or len(c.state) < best[0]):
                    best = (len(c.state), c, key)
        if best is not None:
            best[1].names[best[2]] = name


FALLBACK_SHARE = 0.5
"""The share of the trained parameters from which a vmap fallback is reported."""


def _report_fallbacks(layers: list[_Layer], params: Params, told: set[str]) -> None:
    """Warn once per module (per ghost step) where a vmap fallback reruns a subtree
    holding at least ``FALLBACK_SHARE`` of the trained parameters (a root module that
    owns a parameter, such as a ViT's ``cls_token``, makes the whole model the
    fallback): the ghost step then costs about what the vmap path costs."""
    total = sum(p.numel() for p in params.values()) or 1
    trained = {id(p) for p in params.values()}
    for layer in layers:
        if not isinstance(layer, _Vmapped):
            continue
        call = layer.call
        covered = sum(t.numel() for t in call.state.values() if id(t) in trained)
        module = _module_path(call.names)
        if covered / total < FALLBACK_SHARE or module in told:
            continue
        told.add(module)
        where = f"module '{module}'" if module else "the root module"
        warnings.warn(
            f"fg.ghost_clip: the vmap fallback for {where} ({type(call.module).__name__}, "
            f"which owns {sorted(call.names)} and has no per-sample rule) reruns a "
            f"subtree holding {covered / total:.0%} of the trained parameters for every "
            "sample, so this ghost step costs about what the vmap path costs. Move those "
            "parameters into a module of their own (an nn.Embedding, a small module "
            "adding them) or freeze them to keep the ghost cost.",
            stacklevel=2,
        )


def _layer(call: _Call, n: int) -> _Layer:
    """The fastest exact rule for this call's module (else :class:`_Vmapped`)."""
    m, args = call.module, call.args
    x = args[0] if len(args) == 1 and not call.kwargs and isinstance(args[0], Tensor) else None
    only = set(call.names) <= {"weight", "bias"}
    if x is None or not only or call.n_out != 1:
        return _Vmapped(call, n)
    b = call.grads[0]
    if call.shared:  # what each sample saw: the same input
        x = x.expand(n, *x.shape)
    if type(m) is nn.Linear or _hf_conv1d(m):
        weight = m._parameters["weight"]
        assert weight is not None
        return _Matmul(call, n, x.reshape(n, -1, x.shape[-1]), b.reshape(n, -1, b.shape[-1]),
                       weight.shape, t=type(m) is not nn.Linear)  # fmt: skip
    if (
        isinstance(m, (nn.Conv1d, nn.Conv2d))
        and type(m) in (nn.Conv1d, nn.Conv2d)
        and _unfoldable(m)
    ):
        if m.in_channels * math.prod(m.kernel_size) >= 64:
            return _GroupedConv(call, n, x, b)
        two = type(m) is nn.Conv2d
        xx = x if two else x.unsqueeze(2)

        def pair(v: Any, flat: int) -> tuple[int, int]:
            return (int(v[0]), int(v[1])) if two else (flat, int(v[0]))

        cols = F.unfold(
            xx, pair(m.kernel_size, 1), dilation=pair(m.dilation, 1),
            padding=pair(m.padding, 0), stride=pair(m.stride, 1),
        )  # fmt: skip  # [B, Cin k, L]
        return _Matmul(call, n, cols.transpose(1, 2), b.reshape(n, b.shape[1], -1).transpose(1, 2),
                       m.weight.shape)  # fmt: skip
    if type(m) is nn.Embedding and not (m.max_norm or m.scale_grad_by_freq or m.sparse):
        return _Embedding(call, n, x, b)
    # Normalization layers: the normalized input from torch's own kernel (the module's
    # forward without its affine part), then the affine part's per-sample gradients.
    if type(m) is nn.LayerNorm and m.elementwise_affine:
        k = len(m.normalized_shape)
        xhat = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
        return _Affine(call, n, xhat, b, tuple(range(1, x.dim() - k)))
    if type(m) is nn.RMSNorm and m.elementwise_affine:
        k = len(m.normalized_shape)
        xhat = F.rms_norm(x, m.normalized_shape, None, m.eps)
        return _Affine(call, n, xhat, b, tuple(range(1, x.dim() - k)))
    if type(m) is nn.GroupNorm and m.affine and x.dim() >= 2:
        xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
        return _Affine(call, n, xhat, b, tuple(range(2, x.dim())))
    return _Vmapped(call, n)


def _hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's projections): ``addmm(bias, x, weight)`` with the
    weight stored ``[in, out]``, a Linear with the weight transposed. Known by its class
    (transformers is not imported for it) and checked by its shapes."""
    cls = type(m)
    w, bias = m._parameters.get("weight"), m._parameters.get("bias")
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__ == "transformers.pytorch_utils"
        and w is not None
        and bias is not None
        and w.dim() == 2
        and tuple(w.shape) == (getattr(m, "nx", None), getattr(m, "nf", None))
        and tuple(bias.shape) == (w.shape[1],)
    )


def _unfoldable(m: nn.Conv1d | nn.Conv2d) -> bool:
    return m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)


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
        lead = [sh and _broadcast_lead([s for s, _ in leaves]) for leaves, sh in shapes]
        zs = [
            torch.zeros(
                (n, *s[1:]) if lead[c] else (n, *s) if shared else s, dtype=dt, device=first.device
            )
            for c, (leaves, shared) in enumerate(shapes)
            for s, dt in leaves
        ]
        calls: list[_Call] = []

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
        _adopt_read_directly(calls, params)
        layers = [_layer(c, n) for c in calls]
        if not compiling():
            _report_fallbacks(layers, params, told)
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
