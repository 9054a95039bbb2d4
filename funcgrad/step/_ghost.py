"""Per-sample clipping from per-sample gradient norms, without per-sample gradients.

``fg.make_step(..., per_sample=fg.ghost_clip(C))`` clips every sample's gradient to
norm ``C`` and averages, as ``per_sample=fg.clip_by_global_norm(C)`` does under
``vmap``, in one forward and one backward of the batch (ghost clipping, Li et al.
2021; book-keeping, Bu et al. 2023):

1. a forward in which every module that owns trained parameters has a zero tensor
   ``z`` added to its output (a global forward hook, inert outside this pass), and
   records its inputs;
2. one ``torch.func.grad`` with respect to the ``z``'s: each module's output gradient
   ``b``, sample by sample (the batch's loss is the mean or sum of the samples'), and
   never the parameters' gradients;
3. from each module's inputs ``a`` and ``b``, every sample's squared gradient norm
   (:class:`_Linear`: ``|a|^2 |b|^2`` per position, or the Gram form
   ``sum((a a^T) * (b b^T))`` over a sequence, or the per-sample matrix, whichever
   costs less; convolutions through ``unfold``; embeddings over equal indices;
   normalization layers from their normalized input; any other module through a
   ``vmap`` over its own parameters only);
4. the clip factors ``c_i = min(1, C / (norm_i + 1e-6))`` (``fg.rules.clip_norm``'s), and
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
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap

from .._compat import tree_flatten, tree_unflatten
from ..core._base import LossFn, Params
from ._errors import PER_SAMPLE_BATCHNORM

EPS = 1e-6
"""``fg.rules.clip_norm``'s: ``c = min(1, max_norm / (norm + EPS))``."""


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
        self.zs: Sequence[Tensor] = ()
        self.used = 0
        self.calls: list[_Call] | None = None
        self.batch = 0


_TAP = _Tap()
_HOOK: Any = None
_HOOK_LOCK = threading.Lock()


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
        self.leaves: list[Any] = []  # (args, kwargs) flattened, while torch.func unwraps
        self.spec: Any = None


def install() -> None:
    """Register the global forward hook once (it does nothing outside a ghost pass)."""
    global _HOOK
    with _HOOK_LOCK:
        if _HOOK is None:
            _HOOK = nn.modules.module.register_module_forward_hook(_hook, with_kwargs=True)


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
    for i in slots:
        t = leaves[i]
        if t.dim() == 0 or t.shape[0] != _TAP.batch:
            raise ValueError(
                f"fg.ghost_clip: {type(module).__name__} (parameters "
                f"{sorted(names.values())}) returned a tensor of shape {tuple(t.shape)}, "
                f"whose leading dimension is not the batch ({_TAP.batch}). Ghost clipping "
                "needs every module with trained parameters to keep the batch first "
                "(batch_first=True for RNNs and attention); use "
                "per_sample=fg.clip_by_global_norm(max_norm) otherwise."
            )
    if mode == "probe":
        assert _TAP.shapes is not None
        _TAP.shapes.append([(tuple(leaves[i].shape), leaves[i].dtype) for i in slots])
        return None
    assert _TAP.calls is not None
    new = list(leaves)
    for i in slots:
        new[i] = leaves[i] + _TAP.zs[_TAP.used]
        _TAP.used += 1
    call = _Call(module, names, args, kwargs, len(slots))
    if type(module) not in _RULES:
        call.state = {
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
        _TAP.used = 0


def _signature(params: Params, batch: tuple[Any, ...]) -> Any:
    def sig(t: Any) -> Any:
        if isinstance(t, Tensor):
            return (tuple(t.shape), t.dtype, t.device)
        return type(t)

    return (tuple((k, sig(v)) for k, v in params.items()), tuple(sig(b) for b in batch))


def _probe(
    loss_fn: LossFn, params: Params, batch: tuple[Any, ...], n: int, cache: dict[Any, Shapes]
) -> Shapes:
    """The output shapes of the modules the tap pass will tap, in call order; eagerly
    from a forward on meta tensors, cached in ``cache`` (one per ghost step) by the
    inputs' signature."""
    if torch.compiler.is_compiling():  # traced: a forward whose results are unused
        with _Passing("probe", list(params.items()), n) as tap, torch.no_grad():
            tap.shapes = []
            loss_fn(params, *batch)
            return tap.shapes
    key = _signature(params, batch)
    hit = cache.get(key)
    if hit is not None:
        return hit

    def meta(t: Any) -> Any:
        return torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t

    mparams = {k: meta(v) for k, v in params.items()}
    try:
        with _Passing("probe", list(mparams.items()), n) as tap, torch.no_grad():
            tap.shapes = []
            loss_fn(mparams, *(meta(b) for b in batch))
            shapes = tap.shapes
    except (NotImplementedError, RuntimeError):  # an op without a meta kernel
        with _Passing("probe", list(params.items()), n) as tap, torch.no_grad():
            tap.shapes = []
            loss_fn(params, *batch)
            shapes = tap.shapes
    if len(cache) > 64:  # shapes that keep changing: keep the cache small
        cache.clear()
    cache[key] = shapes
    return shapes


# -- per module type: norms and weighted sums from inputs a and output gradients b --


class _Layer:
    """The per-sample gradients of one call's trained parameters, from what it saw.

    ``norms2()``: each parameter's per-sample squared norm ``[B]``; ``weighted(w)``:
    ``sum_i w_i g_i``; ``per_sample()``: ``[B, *shape]`` (for parameters reached by
    several calls). Parameters are keyed by their names in ``params``."""

    def __init__(self, call: _Call, n: int) -> None:
        self.call, self.n = call, n

    def norms2(self) -> dict[str, Tensor]:
        return {k: g.flatten(1).square().sum(1) for k, g in self.per_sample().items()}

    def weighted(self, w: Tensor) -> dict[str, Tensor]:
        return {k: torch.tensordot(w, g, dims=1) for k, g in self.per_sample().items()}

    def per_sample(self) -> dict[str, Tensor]:
        raise NotImplementedError


class _Matmul(_Layer):
    """``out = a @ W^T + bias`` over positions: Linear, and convolutions unfolded."""

    def __init__(self, call: _Call, n: int, a: Tensor, b: Tensor, shape: torch.Size) -> None:
        super().__init__(call, n)
        self.a, self.b, self.shape = a, b, shape  # a [B, T, in], b [B, T, out]

    def _w(self) -> str | None:
        return self.call.names.get("weight")

    def _bias(self) -> str | None:
        return self.call.names.get("bias")

    def norms2(self) -> dict[str, Tensor]:
        a, b = self.a, self.b
        out: dict[str, Tensor] = {}
        if (w := self._w()) is not None:
            t, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
            if t == 1:  # rank one: |a|^2 |b|^2
                out[w] = a.square().sum((1, 2)) * b.square().sum((1, 2))
            elif t * (d_in + d_out) <= d_in * d_out:  # Gram form, B T^2 (in + out)
                out[w] = ((a @ a.transpose(1, 2)) * (b @ b.transpose(1, 2))).sum((1, 2))
            else:  # the per-sample matrix, B T in out
                out[w] = torch.einsum("bto,bti->boi", b, a).square().sum((1, 2))
        if (k := self._bias()) is not None:
            out[k] = b.sum(1).square().sum(1)
        return out

    def weighted(self, w: Tensor) -> dict[str, Tensor]:
        bw = self.b * w[:, None, None]
        out: dict[str, Tensor] = {}
        if (k := self._w()) is not None:
            out[k] = torch.einsum("bto,bti->oi", bw, self.a).reshape(self.shape)
        if (k := self._bias()) is not None:
            out[k] = bw.sum((0, 1))
        return out

    def per_sample(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if (k := self._w()) is not None:
            g = torch.einsum("bto,bti->boi", self.b, self.a)
            out[k] = g.reshape(self.n, *self.shape)
        if (k := self._bias()) is not None:
            out[k] = self.b.sum(1)
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
        batched = [
            isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == self.n for t in arg_leaves
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
            (g,) = back([c.unsqueeze(0) for c in cot])
            return g  # type: ignore[no-any-return]

        xs = [t for t, isb in zip(arg_leaves, batched, strict=True) if isb]
        in_dims = (None, 0) + (0,) * len(xs)
        g = vmap(one, in_dims=in_dims, randomness="same")(own, call.grads, *xs)
        return {call.names[o]: v for o, v in g.items()}


_RULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
"""Module types with a rule of their own below (others: :class:`_Vmapped`)."""


def _layer(call: _Call, n: int) -> _Layer:
    """The fastest exact rule for this call's module (else :class:`_Vmapped`)."""
    m, args = call.module, call.args
    x = args[0] if len(args) == 1 and not call.kwargs and isinstance(args[0], Tensor) else None
    only = set(call.names) <= {"weight", "bias"}
    if x is None or not only or call.n_out != 1:
        return _Vmapped(call, n)
    b = call.grads[0]
    if type(m) is nn.Linear:
        return _Matmul(call, n, x.reshape(n, -1, x.shape[-1]), b.reshape(n, -1, b.shape[-1]),
                       m.weight.shape)  # fmt: skip
    if (
        isinstance(m, (nn.Conv1d, nn.Conv2d))
        and type(m) in (nn.Conv1d, nn.Conv2d)
        and _unfoldable(m)
    ):
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
    if type(m) is nn.LayerNorm and m.elementwise_affine:
        k = len(m.normalized_shape)
        dims = tuple(range(-k, 0))
        var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=0)
        xhat = (x - mean) * torch.rsqrt(var + m.eps)
        return _Affine(call, n, xhat, b, tuple(range(1, x.dim() - k)))
    if type(m) is nn.RMSNorm and m.elementwise_affine:
        k = len(m.normalized_shape)
        dims = tuple(range(-k, 0))
        eps = m.eps if m.eps is not None else torch.finfo(x.dtype).eps
        xhat = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
        return _Affine(call, n, xhat, b, tuple(range(1, x.dim() - k)))
    if type(m) is nn.GroupNorm and m.affine and x.dim() >= 2:
        g = x.reshape(n, m.num_groups, -1)
        var, mean = torch.var_mean(g, dim=2, keepdim=True, correction=0)
        xhat = ((g - mean) * torch.rsqrt(var + m.eps)).reshape(x.shape)
        spatial = tuple(range(2, x.dim()))
        return _Affine(call, n, xhat, b, spatial)
    return _Vmapped(call, n)


def _unfoldable(m: nn.Conv1d | nn.Conv2d) -> bool:
    return m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def ghost_gradients(
    loss_fn: LossFn, has_aux: bool, max_norm: float, reduction: str
) -> Callable[..., tuple[Params, Tensor, Any, Any]]:
    """``fn(params, *batch) -> (grads, loss, None, aux)``: the mean over the batch of
    each sample's gradient clipped to ``max_norm`` (see the module docstring); ``loss``
    the mean of the samples' losses; ``aux`` the batch's loss_fn's."""
    install()
    cache: dict[Any, Shapes] = {}

    def fn(params: Params, *batch: Any) -> tuple[Params, Tensor, Any, Any]:
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
        zs = [
            torch.zeros(s, dtype=dt, device=first.device) for leaves in shapes for s, dt in leaves
        ]
        calls: list[_Call] = []

        def tapped(zs: list[Tensor]) -> Any:
            with _Passing("tap", list(params.items()), n) as tap:
                tap.zs, tap.calls = zs, calls
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
        scale = float(n) if reduction == "mean" else 1.0
        it = iter(gz)
        for c in calls:
            leaves = [next(seen) if isinstance(t, Tensor) else t for t in c.leaves]
            c.args, c.kwargs = tree_unflatten(leaves, c.spec)
            c.grads = [next(it) * scale for _ in range(c.n_out)]
        layers = [_layer(c, n) for c in calls]
        reached: dict[str, int] = {}
        for c in calls:
            for name in c.names.values():
                reached[name] = reached.get(name, 0) + 1
        missing = sorted(set(params) - set(reached))
        if missing:
            raise ValueError(
                f"fg.ghost_clip: parameters {missing} are not used by any module call "
                "(read directly in the loss, or in a module's forward through "
                "functional ops on another module's parameters). Ghost clipping sees "
                "parameters through the modules that own them; use "
                "per_sample=fg.clip_by_global_norm(max_norm) for this model."
            )
        norms2 = torch.zeros(n, dtype=torch.promote_types(first.dtype, torch.float32),
                             device=first.device)  # fmt: skip
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
        coef = torch.clamp(max_norm / (norms2.sqrt() + EPS), max=1.0)
        w = coef / n
        grads: dict[str, Tensor] = {}
        for layer in alone:
            grads.update(layer.weighted(w.to(layer.call.grads[0].dtype)))
        for k, g in shared.items():
            grads[k] = torch.tensordot(w.to(g.dtype), g, dims=1)
        out = {k: grads[k].to(p.dtype).reshape(p.shape) for k, p in params.items()}
        mean_loss = loss.detach() if reduction == "mean" else loss.detach() / n
        return out, mean_loss, None, aux

    return fn
