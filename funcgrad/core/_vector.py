"""All parameters as one flat vector and back, in order (torch's ``LBFGS`` layout:
each parameter flattened, concatenated): for optimizers that work on the whole vector
(``fg.lbfgs``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._base import Params


def flat_vector(params: Params, who: str) -> Tensor:
    """The parameters as one vector, in order (torch's ``_gather_flat_grad`` layout)."""
    tensors = list(params.values())
    if not tensors:
        raise ValueError(f"{who}: no parameters.")
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise TypeError(
            f"{who}: L-BFGS works on one flat vector of all parameters, which needs one "
            f"dtype and device; got {sorted(map(str, kinds))}. Convert the model "
            "(model.double()) or optimize each part with its own fg.lbfgs."
        )
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(x: Tensor, like: Params) -> dict[str, Tensor]:
    """``x`` cut into views shaped as ``like``'s tensors, by name (no copy)."""
    out, i = {}, 0
    for k, p in like.items():
        out[k] = x[i : i + p.numel()].view_as(p)
        i += p.numel()
    return out
