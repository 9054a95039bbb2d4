"""Ghost clipping's rule for ``nn.MultiheadAttention`` (``_ghost_layers.layer_of``).

The module reads its projection weights directly (no call of ``out_proj`` to tap), so
without a rule it is a per-sample ``vmap`` of the module. Here, from the call's inputs
and its output gradient ``b``: the attention output before the output projection ``A``
and its gradient ``b @ W_out``, then one batched ``vjp`` of the attention core (the
samples do not mix in it) gives the gradients at the projected queries, keys and
values. Each projection is then a Linear map (``_Matmul``): the input projection's
three row blocks and the output projection, norms and weighted sums as for Linear.
Taken where the module is ``batch_first``, packs its projections, has no ``bias_k``,
``add_zero_attn`` or dropout, and is called with ``need_weights=False`` and no masks;
otherwise the vmap fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vjp

from ._ghost_layers import Layer, _Matmul
from ._ghost_tap import Call

_IN = ("in_proj_weight", "in_proj_bias")
_OUT = ("out_proj.weight", "out_proj.bias")


def attention_layer(call: Call, n: int) -> Layer | None:
    """The rule for this call of an ``nn.MultiheadAttention``, or None (the fallback)."""
    m, args, kw = call.module, call.args, dict(call.kwargs)
    if not (
        type(m) is nn.MultiheadAttention
        and m.batch_first
        and m._qkv_same_embed_dim
        and m.bias_k is None
        and not m.add_zero_attn
        and (m.dropout == 0.0 or not m.training)
        and len(args) == 3
        and all(isinstance(t, Tensor) and t.dim() == 3 and t.shape[0] == n for t in args)
        and kw.pop("need_weights", True) is False
        and kw.pop("attn_mask", None) is None
        and kw.pop("key_padding_mask", None) is None
        and kw.pop("is_causal", False) is False
        and kw.pop("average_attn_weights", True) in (True, False)
        and not kw
        and call.n_out == 1
        and not call.shared
        and set(call.names) <= {*_IN, *_OUT}
        and "in_proj_weight" in call.state
    ):
        return None
    return _Attention(call, n)


class _Attention(Layer):
    def __init__(self, call: Call, n: int) -> None:
        super().__init__(call, n)
        m, (q_in, k_in, v_in), b = call.module, call.args, call.grads[0]
        assert isinstance(m, nn.MultiheadAttention)
        e, heads = int(m.embed_dim), int(m.num_heads)
        w, bias = call.state["in_proj_weight"], call.state.get("in_proj_bias")
        rows = [slice(0, e), slice(e, 2 * e), slice(2 * e, 3 * e)]
        q, k, v = (
            F.linear(x, w[r], None if bias is None else bias[r])
            for x, r in zip((q_in, k_in, v_in), rows, strict=True)
        )

        def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            def split(t: Tensor) -> Tensor:  # [B, T, E] -> [B, heads, T, E / heads]
                return t.reshape(n, t.shape[1], heads, e // heads).transpose(1, 2)

            a = F.scaled_dot_product_attention(split(q), split(k), split(v))
            return a.transpose(1, 2).reshape(n, q.shape[1], e)

        a, back = vjp(core, q, k, v)  # type: ignore[misc]
        grads = back(b @ call.state["out_proj.weight"])
        # in_proj's row blocks and out_proj as Linear maps under their own keys
        self.blocks = [
            _Matmul(_pseudo(call, f"in{i}", _IN), n, x, g, w[r].shape)
            for i, (x, g, r) in enumerate(zip((q_in, k_in, v_in), grads, rows, strict=True))
        ]
        self.out = _Matmul(_pseudo(call, "out", _OUT), n, a, b, call.state[_OUT[0]].shape)

    def _merge(
        self, parts: list[dict[str, Tensor]], out: dict[str, Tensor], dim: int, add: bool
    ) -> dict[str, Tensor]:
        merged: dict[str, Tensor] = {}
        names = self.call.names
        for own, key in zip(_IN, ("weight", "bias"), strict=True):
            if own in names:
                each = [p[f"in{i}.{key}"] for i, p in enumerate(parts)]
                merged[names[own]] = sum(each[1:], each[0]) if add else torch.cat(each, dim)
        for own, key in zip(_OUT, ("weight", "bias"), strict=True):
            if own in names:
                merged[names[own]] = out[f"out.{key}"]
        return merged

    def norms2(self) -> dict[str, Tensor]:
        return self._merge([m.norms2() for m in self.blocks], self.out.norms2(), 0, True)

    def weighted(self, w: Tensor) -> dict[str, Tensor]:
        parts = [m.weighted(w) for m in self.blocks]
        return self._merge(parts, self.out.weighted(w), 0, False)

    def per_sample(self) -> dict[str, Tensor]:
        parts = [m.per_sample() for m in self.blocks]
        return self._merge(parts, self.out.per_sample(), 1, False)


def _pseudo(call: Call, tag: str, own: tuple[str, str]) -> Call:
    """A stand-in call whose ``weight``/``bias`` keys are ``tag.weight``/``tag.bias``
    where the module's parameters ``own`` (its weight's and bias's names) are trained."""
    keys = {
        key: f"{tag}.{key}"
        for key, name in zip(("weight", "bias"), own, strict=True)
        if name in call.names
    }
    return Call(call.module, keys, (), {}, 1)
