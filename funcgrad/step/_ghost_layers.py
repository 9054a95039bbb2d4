"""Ghost clipping's per-module-type arithmetic (funcgrad/step/_ghost.py runs the pass).

From one call's inputs ``a`` and output gradients ``b``: every sample's squared
gradient norm of the module's own parameters, and the clipped, weighted sum of the
per-sample gradients (book-keeping). Linear and transposed-Linear maps (``_Matmul``),
grouped convolutions through ``unfold``, embeddings over equal indices, normalization
layers from their normalized input, and a ``vmap`` over the module's own parameters for
any other module (``Vmapped``, the fallback, reported once per module).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from .._compat import compiling, tree_flatten, tree_unflatten
from ..core._base import Params
from ._ghost_tap import Call, float_leaves, module_path, rerunning, stubbed


class Layer:
    """The per-sample gradients of one call's trained parameters, from what it saw.

    ``norms2()``: each parameter's per-sample squared norm ``[B]``; ``weighted(w)``:
    ``sum_i w_i g_i``; ``per_sample()``: ``[B, *shape]`` (for parameters reached by
    several calls). Parameters are keyed by their names in ``params``."""

    def __init__(self, call: Call, n: int) -> None:
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


class _Matmul(Layer):
    """``out = a @ W^T + bias`` over positions: Linear, and convolutions unfolded."""

    def __init__(
        self, call: Call, n: int, a: Tensor, b: Tensor, shape: torch.Size, t: bool = False
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


class _GroupedConv(Layer):
    """A convolution's per-sample weight gradients as one grouped convolution backward
    (the samples as groups, times the convolution's own groups): on the CPU faster than
    unfolding where the unfolded rows are long (``Cin * kernel >= 64``), slower where
    they are short; the rule for grouped and depthwise convolutions."""

    def __init__(self, call: Call, n: int, x: Tensor, b: Tensor) -> None:
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
            [0] * (weight.dim() - 2), n * m.groups, [False, True, False],
        )[1]  # fmt: skip
        out = {self.call.names["weight"]: g.reshape(n, *weight.shape)}
        if (k := self.call.names.get("bias")) is not None:
            out[k] = self.b.flatten(2).sum(2)
        return out


class _Embedding(Layer):
    def __init__(self, call: Call, n: int, idx: Tensor, b: Tensor) -> None:
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


class _Affine(Layer):
    """Normalization layers: ``out = xhat * weight + bias``, per-sample gradients small
    (``[B, *normalized_shape]``): formed from ``xhat`` and ``b``."""

    def __init__(self, call: Call, n: int, xhat: Tensor, b: Tensor, dims: tuple[int, ...]):
        super().__init__(call, n)
        self.xhat, self.b, self.dims = xhat, b, dims  # dims: summed over (not the batch)

    def per_sample(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        if (k := self.call.names.get("weight")) is not None:
            out[k] = (self.b * self.xhat).sum(self.dims) if self.dims else self.b * self.xhat
        if (k := self.call.names.get("bias")) is not None:
            out[k] = self.b.sum(self.dims) if self.dims else self.b
        return out


class Vmapped(Layer):
    """Any other module: its own parameters' per-sample gradients by ``vmap`` of a
    ``vjp`` of the module alone, sample by sample.

    Narrow (:attr:`narrow`), where the module made its own calls with the batch first
    and by position: the rerun runs only the module's own code, each call it makes
    returning what it returned in the tap pass, and the ``vjp`` takes as cotangents the
    gradients at those calls' inputs (tapped) and at the module's output: every path
    from the module's own parameters to the loss passes through one of them. Otherwise
    the module's whole subtree reruns for every sample."""

    def __init__(self, call: Call, n: int) -> None:
        super().__init__(call, n)
        _refuse_cache(call)
        kids = call.children or []
        self.narrow = (
            call.children is not None
            and not call.shared
            and all("." not in own for own in call.names)  # nothing read from a child
            and all(
                k.batched_in
                and not k.float_kwargs
                and all(
                    not isinstance(t, Tensor) or (t.is_floating_point() and t.dim() > 0
                                                  and t.shape[0] == n)
                    for t in k.leaves
                )
                for k in kids
            )
        )  # fmt: skip

    def covered(self) -> list[Tensor]:
        """The tensors whose use each sample's rerun repeats."""
        if self.narrow:
            return [self.call.state[o] for o in self.call.names]
        return list(self.call.state.values())

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
        kids = (call.children or []) if self.narrow else []
        outs = [[t for t in k.leaves if isinstance(t, Tensor)] for k in kids]
        in_cots = [g for k in kids for g in k.in_grads]
        module, modules = call.module, [k.module for k in kids]
        if self.narrow:  # the calls' own tensors are never used: only the module's own
            rest = {k: t for k, t in rest.items() if "." not in k}

        def one(
            mp: dict[str, Tensor], cot: list[Tensor], kin: list[Tensor],
            kout: list[list[Tensor]], *xs: Any,
        ) -> dict[str, Tensor]:  # fmt: skip
            it = iter(xs)
            leaves = [
                next(it).unsqueeze(0) if isb else t
                for t, isb in zip(arg_leaves, batched, strict=True)
            ]
            rebuilt: Any = tree_unflatten(leaves, arg_spec)
            args, kwargs = rebuilt

            def f(p: dict[str, Tensor]) -> list[Tensor]:
                if not self.narrow:
                    out = functional_call(module, {**rest, **p}, tuple(args), kwargs)
                    captured: list[Tensor] = []
                else:
                    mine = [[t.unsqueeze(0) for t in ts] for ts in kout]
                    with stubbed(modules, kids, mine) as captured:
                        out = functional_call(module, {**rest, **p}, tuple(args), kwargs)
                outs_, _ = float_leaves(out)
                floats = [t for t in outs_ if isinstance(t, Tensor) and t.is_floating_point()]
                return list(captured) + floats

            back = vjp(f, mp)[1]
            up = [c.unsqueeze(0) for c in kin]
            lead = zip(cot, call.lead, strict=True)  # a 1 that took the batch: (1, ...) now
            (g,) = back(up + [c if call.shared or le else c.unsqueeze(0) for c, le in lead])
            return g  # type: ignore[no-any-return]

        xs = [t for t, isb in zip(arg_leaves, batched, strict=True) if isb]
        in_dims = (None, 0, 0, 0) + (0,) * len(xs)
        # Eagerly the rerun swaps tensors in the module itself, as fg.call does: it takes
        # turns with fg.call's forwards through the same model, and the calls it makes
        # skip their forwards meanwhile (rerunning). Traced, their results drop out.
        with contextlib.nullcontext() if compiling() else rerunning(call.root, modules):
            g = vmap(one, in_dims=in_dims, randomness="same")(own, call.grads, in_cots, outs, *xs)
        return {call.names[o]: v for o, v in g.items()}


def _refuse_cache(call: Call) -> None:
    """A Hugging Face cache among a rerun module's arguments: the tap pass filled it, and
    the rerun would add its keys and values again (an error, or with one sample, attention
    over twice the keys)."""
    for v in [*call.args, *call.kwargs.values()]:
        if any(
            c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils"
            for c in type(v).__mro__
        ):
            path = module_path(call.names)
            raise ValueError(
                f"fg.ghost_clip: {f'the module {path!r}' if path else 'the root module'} "
                f"({type(call.module).__name__}) has no per-sample rule and reruns for every "
                f"sample, but it was called with a transformers cache ({type(v).__name__}), "
                "which the rerun would fill a second time. Call the model with "
                "use_cache=False to train (fg.call(model, p, ..., use_cache=False)), or "
                "use per_sample=fg.clip_by_global_norm(max_norm)."
            )


def adopt_read_directly(calls: list[Call], params: Params) -> None:
    """A trained parameter that no call of its own module reached, read directly by an
    ancestor that was called (``nn.MultiheadAttention`` reads ``out_proj.weight``
    without calling ``out_proj``): the smallest such ancestor's call takes it, and
    its per-sample gradients come from the vmap of that module (:class:`Vmapped`)."""
    reached = {name for c in calls for name in c.names.values()}
    for name, t in params.items():
        if name in reached:
            continue
        best: tuple[int, Call, str] | None = None
        for c in calls:
            for key, v in c.state.items():
                if v is t and (best is None or len(c.state) < best[0]):
                    best = (len(c.state), c, key)
        if best is not None:
            best[1].names[best[2]] = name


FALLBACK_SHARE = 0.5
"""The share of the trained parameters from which a vmap fallback is reported."""


def report_fallbacks(layers: list[Layer], params: Params, told: set[str]) -> None:
    """Warn once per module (per ghost step) where a vmap fallback reruns a subtree
    holding at least ``FALLBACK_SHARE`` of the trained parameters (a root module that
    owns a parameter, such as a ViT's ``cls_token``, makes the whole model the
    fallback): the ghost step then costs about what the vmap path costs."""
    total = sum(p.numel() for p in params.values()) or 1
    trained = {id(p) for p in params.values()}
    for layer in layers:
        if not isinstance(layer, Vmapped):
            continue
        call = layer.call
        covered = sum(t.numel() for t in layer.covered() if id(t) in trained)
        module = module_path(call.names)
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


def layer_of(call: Call, n: int) -> Layer:
    """The fastest exact rule for this call's module (else :class:`Vmapped`)."""
    m, args = call.module, call.args
    from ._ghost_hf import ScaleNorm, hf_conv1d, hf_embed_scale, hf_scale_norm  # (on Layer)

    if type(m) is nn.MultiheadAttention:
        from ._ghost_attention import attention_layer  # (it builds on _Matmul, here)

        if (attention := attention_layer(call, n)) is not None:
            return attention
    x = args[0] if len(args) == 1 and not call.kwargs and isinstance(args[0], Tensor) else None
    only = set(call.names) <= {"weight", "bias"}
    if x is None or not only or call.n_out != 1:
        return Vmapped(call, n)
    b = call.grads[0]
    if call.shared:  # what each sample saw: the same input
        x = x.expand(n, *x.shape)
    if type(m) is nn.Linear or hf_conv1d(m):
        weight = m._parameters["weight"]
        assert weight is not None
        return _Matmul(call, n, x.reshape(n, -1, x.shape[-1]), b.reshape(n, -1, b.shape[-1]),
                       weight.shape, t=type(m) is not nn.Linear)  # fmt: skip
    if (
        isinstance(m, (nn.Conv1d, nn.Conv2d))
        and type(m) in (nn.Conv1d, nn.Conv2d)
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    ):
        # Grouped (depthwise) convolutions, and long unfolded rows: the samples as
        # groups (per-sample weight gradients), unless few output positions make the
        # Gram form of the unfolded input cheaper (deep layers of an image model).
        rows, out = m.in_channels * math.prod(m.kernel_size), m.out_channels
        positions = b[0].numel() // out
        gram = positions * (rows + out) <= rows * out
        if m.groups > 1 or (rows >= 64 and not gram):
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
    if isinstance(m, nn.Embedding) and not (m.max_norm or m.scale_grad_by_freq or m.sparse):
        if type(m) is nn.Embedding:
            return _Embedding(call, n, x, b)
        if (scale := hf_embed_scale(call, x, b)) is not None:  # Gemma's: the output times it
            return _Embedding(call, n, x, b * scale)
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
    if (
        isinstance(m, nn.modules.batchnorm._BatchNorm)
        and type(m) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        and m.affine
        and not m.training
        and (mean := call.state.get("running_mean")) is not None
        and (var := call.state.get("running_var")) is not None
    ):  # eval mode: its running statistics, the same for every sample
        xhat = F.batch_norm(x, mean, var, None, None, False, 0.0, m.eps)
        return _Affine(call, n, xhat, b, tuple(range(2, x.dim())))
    if type(m) is nn.GroupNorm and m.affine and x.dim() >= 2:
        xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
        return _Affine(call, n, xhat, b, tuple(range(2, x.dim())))
    if hf_scale_norm(m, x, b):
        return ScaleNorm(call, n, x, b)
    return Vmapped(call, n)
