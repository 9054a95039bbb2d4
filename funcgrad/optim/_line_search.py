"""The strong-Wolfe line search of ``fg.lbfgs`` (Nocedal & Wright, "Numerical
Optimization", algorithms 3.5 and 3.6, with cubic interpolation): the decisions and the
order of the arithmetic are ``torch.optim.LBFGS``'s, so the step lengths are the same
numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor


def cubic_min(
    a: Any, fa: Any, ga: Any, b: Any, fb: Any, gb: Any, bounds: tuple[Any, Any] | None = None
) -> Any:
    """The minimizer of the cubic through ``(a, fa)`` and ``(b, fb)`` with slopes ``ga``,
    ``gb``, clamped to ``bounds`` (the interval between a and b by default); the
    bounds' midpoint where the cubic has none."""
    lo, hi = bounds if bounds is not None else ((a, b) if a <= b else (b, a))
    d1 = ga + gb - 3 * (fa - fb) / (a - b)
    disc = d1**2 - ga * gb
    if disc < 0:
        return (lo + hi) / 2.0
    d2 = disc.sqrt()
    if a <= b:
        at = b - (b - a) * ((gb + d2 - d1) / (gb - ga + 2 * d2))
    else:
        at = a - (a - b) * ((ga + d2 - d1) / (ga - gb + 2 * d2))
    return min(max(at, lo), hi)


class Point(NamedTuple):
    """A trial step length ``t`` with the loss, gradient and slope along d there."""

    t: Any
    f: Any
    g: Tensor
    slope: Any


class Found(NamedTuple):
    """What :func:`line_search` found: the loss and gradient at step length ``t``, and
    the evaluations it took."""

    f: Any
    g: Tensor
    t: Any
    evals: int


def line_search(
    at: Callable[[Any], tuple[float, Tensor]],
    d: Tensor,
    start: Point,
    t: Any,
    tolerance_change: float,
    budget: int,
    c1: float = 1e-4,
    c2: float = 0.9,
) -> Found:
    """A step length satisfying the strong Wolfe conditions along ``d`` from ``start``
    (``t=0``), first guess ``t``; at most ``budget`` evaluations of ``at(t) -> (loss,
    gradient)``. Returns the loss, gradient and step length found, and the evaluations."""
    d_scale = d.abs().max()
    f0, slope0 = start.f, start.slope

    def too_high(p: Point) -> bool:  # the sufficient-decrease (Armijo) condition fails
        return bool(p.f > f0 + c1 * p.t * slope0)

    def curvature(p: Point) -> bool:
        return bool(abs(p.slope) <= -c2 * slope0)

    def probe(t: Any) -> Point:
        f, g = at(t)
        return Point(t, f, g, g.dot(d))

    new, evals, tries = probe(t), 1, 0
    prev = start._replace(g=start.g.clone())
    pair: list[Point]
    found = False
    # bracketing: grow t until an interval holds a point that satisfies both
    while True:
        if tries >= budget:
            pair = [start, new]
            break
        if too_high(new) or (tries > 1 and new.f >= prev.f):
            pair = [prev, new._replace(g=new.g.clone())]
            break
        if curvature(new):
            pair, found = [new], True
            break
        if new.slope >= 0:
            pair = [prev, new._replace(g=new.g.clone())]
            break
        guess = cubic_min(
            prev.t, prev.f, prev.slope, new.t, new.f, new.slope,
            bounds=(new.t + 0.01 * (new.t - prev.t), new.t * 10),
        )  # fmt: skip
        prev = new._replace(g=new.g.clone())
        new, evals, tries = probe(guess), evals + 1, tries + 1

    # zoom: shrink the interval around such a point
    low, high = (0, 1) if pair[0].f <= pair[-1].f else (1, 0)
    stuck = False
    while not found and tries < budget:
        ts = (pair[0].t, pair[1].t)
        if abs(ts[1] - ts[0]) * d_scale < tolerance_change:
            break
        guess = cubic_min(*pair[0][:2], pair[0].slope, *pair[1][:2], pair[1].slope)
        wide, narrow = max(ts), min(ts)
        margin = 0.1 * (wide - narrow)
        if min(wide - guess, guess - narrow) < margin:  # too close to an end
            if stuck or guess >= wide or guess <= narrow:
                guess = (
                    wide - margin if abs(guess - wide) < abs(guess - narrow) else narrow + margin
                )
                stuck = False
            else:
                stuck = True
        else:
            stuck = False
        new, evals, tries = probe(guess), evals + 1, tries + 1
        if too_high(new) or new.f >= pair[low].f:
            pair[high] = new._replace(g=new.g.clone())
            low, high = (0, 1) if pair[0].f <= pair[1].f else (1, 0)
        else:
            if curvature(new):
                found = True
            elif new.slope * (pair[high].t - pair[low].t) >= 0:
                pair[high] = pair[low]
            pair[low] = new._replace(g=new.g.clone())
    best = pair[low]
    return Found(best.f, best.g, best.t, evals)
