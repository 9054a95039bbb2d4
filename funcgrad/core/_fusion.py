"""Helpers that steer inductor's fusion without changing any value."""

from __future__ import annotations

from torch import Tensor


def realize(x: Tensor) -> Tensor:
    """Return ``x`` unchanged, computed once into a buffer of its own under inductor.

    Inductor inlines cheap 0-d pointwise math into every consumer loop, and the C++
    compiler cannot hoist it out (the loop also writes through other pointers). The
    Adam scalars (two ``pow``, a ``sqrt``, divisions in float64) were then recomputed
    for every vector of every parameter, which tripled the MLP update's time
    (docs/compile-notes.md, "Figures behind the code"). A reduction over more than
    ``torch._inductor.config.unroll_reductions_threshold`` (8) elements is always
    realized, and the max of 16 copies of a value is that value, bit for bit.
    """
    return x.unsqueeze(-1).expand(*x.shape, 16).amax(-1)
