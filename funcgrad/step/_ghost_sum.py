"""Ghost clipping's last part: every sample's gradient norm from the layers' rules, the
clip factors, and the clipped sum of the per-sample gradients (``_ghost.ghost_gradients``).

A parameter reached by several calls (a tied embedding and output head, a block applied
twice) has a per-sample gradient that is the sum of its calls' ``G_1 + G_2``, whose
squared norm is ``|G_1|^2 + |G_2|^2 + 2 <G_1, G_2>``: each call's own term from its
rule, the cross terms from the calls' factors. ``_Matmul`` holds ``G = L^T R`` over
positions (the output gradients and the inputs; a bias: ones and the summed output
gradients), ``_Embedding`` the same with ``L`` one-hot rows of its indices; then
``<G_1, G_2> = sum((L_1 L_2^T) * (R_1 R_2^T))``, a ``[B, T_1, T_2]`` product, and no
per-sample gradient of a tied embedding is formed. Any other rule gives its per-sample
gradients themselves (``Layer.per_sample``, which its norms use too).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core._base import clip_factor
from ._ghost_layers import Layer, _Embedding, _Matmul

Factor = tuple[str, Tensor, Tensor | None]
"""``("mat", L, R)``: ``G = L^T R`` per sample, ``L`` ``[B, T, rows]``, ``R`` ``[B, T,
cols]``; ``("idx", indices, R)``: ``L`` one-hot over the indices (``[B, T]``);
``("full", G, None)``: ``G`` itself, ``[B, rows, cols]``. ``rows`` is the parameter's
first dimension (1 for a vector), ``cols`` the rest."""


def _factor(layer: Layer, name: str) -> Factor:
    """The call's per-sample gradient of parameter ``name``, as factors where it can."""
    names = layer.call.names
    if isinstance(layer, _Matmul) and names.get("weight") == name:
        return ("mat", layer.a, layer.b) if layer.t else ("mat", layer.b, layer.a)
    if isinstance(layer, _Matmul) and names.get("bias") == name:
        ones = layer.b.new_ones(layer.n, 1, 1)
        return "mat", ones, layer.b.sum(1, keepdim=True)
    if isinstance(layer, _Embedding):
        return "idx", layer.idx, layer.b
    g = layer._once()[name]
    return "full", g.reshape(layer.n, g.shape[1] if g.dim() > 2 else 1, -1), None


def _cross(one: Factor, two: Factor) -> Tensor:
    """``<G_1, G_2>`` per sample, ``[B]``."""
    if one[0] == "full" and two[0] != "full":
        one, two = two, one
    kind1, x1, r1 = one
    kind2, x2, r2 = two
    if kind2 == "full":
        if kind1 == "full":
            return (x1.flatten(1) * x2.flatten(1)).sum(1)
        assert r1 is not None
        if kind1 == "idx":  # the rows of G_2 at the indices, against R_1
            rows = x2.gather(1, x1.unsqueeze(2).expand(-1, -1, x2.shape[2]))
            return (rows * r1).sum((1, 2))
        return (torch.bmm(x2, r1.transpose(1, 2)) * x1.transpose(1, 2)).sum((1, 2))
    assert r1 is not None and r2 is not None
    if kind1 == "idx" and kind2 == "idx":  # equal indices
        left = (x1.unsqueeze(2) == x2.unsqueeze(1)).to(r1.dtype)
    elif kind1 == "idx":  # L_2's columns at the indices: [B, T_2, T_1] -> [B, T_1, T_2]
        left = x2.gather(2, x1.unsqueeze(1).expand(-1, x2.shape[1], -1)).transpose(1, 2)
    elif kind2 == "idx":
        left = x1.gather(2, x2.unsqueeze(1).expand(-1, x1.shape[1], -1))
    else:
        left = torch.bmm(x1, x2.transpose(1, 2))
    return (left * torch.bmm(r1, r2.transpose(1, 2))).sum((1, 2))


def clipped_sum(
    layers: list[Layer], n: int, max_norm: float, scale: float, norms2: Tensor
) -> dict[str, Tensor]:
    """``sum_i c_i g_i * scale / n`` by parameter name, ``c_i`` each sample's clip factor
    from its gradient norm (``norms2``: zeros to add the squared norms to; ``scale``: the
    output gradients' factor, ``n`` for a mean loss)."""
    reached: dict[str, list[Layer]] = {}
    for layer in layers:
        for k in layer.call.names.values():
            reached.setdefault(k, []).append(layer)
        for v in layer.norms2().values():
            norms2 = norms2 + v.to(norms2.dtype)
    for k, calls in reached.items():
        factors = [_factor(layer, k) for layer in calls]
        for i in range(len(factors)):
            for j in range(i + 1, len(factors)):
                norms2 = norms2 + 2 * _cross(factors[i], factors[j]).to(norms2.dtype)
    w = clip_factor(max_norm, (norms2 * scale**2).sqrt()) * (scale / n)
    grads: dict[str, Tensor] = {}
    for layer in layers:
        for k, g in layer.weighted(w.to(layer.call.grads[0].dtype)).items():
            grads[k] = grads[k] + g.reshape(grads[k].shape) if k in grads else g
    return grads
