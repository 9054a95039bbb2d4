"""Walking state trees: optree in eager code, torch's pytree inside traced code.

Eager code (checks before tracing, checkpoints) uses optree with insertion-ordered
dicts, so a message names entries in the user's order and paths read as Python
(``state.inner_states[1].mu['fc1.weight']``, from optree's accessors).

Code that runs inside the step uses ``torch.utils._pytree`` (through
``funcgrad._compat``). On torch 2.13 dynamo traces ``optree.tree_map``, but
``optree.tree_leaves`` / ``tree_flatten`` over a state that holds dicts fail under
``fullgraph=True`` ("Unexpected type in sourceless builder:
optree.registry.DictMetaData"), while torch's own pytree traces both, also over
NamedTuples created while tracing. Both match dict entries by key, not by position.
"""

from __future__ import annotations

import contextlib
import contextvars
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from .. import _compat

NAMESPACE = "funcgrad"
"""The optree namespace in which funcgrad keeps dicts in insertion order, and a
``funcgrad.Flat`` has one child per name (paths, messages, checkpoints)."""

BUFFERS = "funcgrad.buffers"
"""The optree namespace in which a ``funcgrad.Flat``'s children are its buffers
(what a step reads and writes), as in torch's pytree."""


def flatten(tree: Any) -> tuple[list[optree.PyTreeAccessor], list[Any], optree.PyTreeSpec]:
    """optree's ``tree_flatten_with_accessor`` with dicts in insertion order and
    ``None`` as a leaf (so a state that holds one keeps its place). Eager code only."""
    with optree.dict_insertion_ordered(True, namespace=NAMESPACE):
        return optree.tree_flatten_with_accessor(tree, none_is_leaf=True, namespace=NAMESPACE)


def leaves_with_paths(tree: Any, root: str = "") -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs in insertion order, e.g. ``("state.mu['w']", t)``."""
    accessors, leaves, _ = flatten(tree)
    return [(a.codify(root), leaf) for a, leaf in zip(accessors, leaves, strict=True)]


def tensor_paths(tree: Any, root: str = "") -> list[tuple[str, Tensor]]:
    """The tensor leaves of ``tree`` with their paths (see :func:`leaves_with_paths`)."""
    return [(p, t) for p, t in leaves_with_paths(tree, root) if isinstance(t, Tensor)]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn`` over the leaves of trees of the same structure; traceable by dynamo."""
    return _compat.tree_map(fn, tree, *rest)


def _copy(dst: Tensor, src: Tensor) -> Tensor:
    if dst.dim() == 0:
        # torch 2.13: under torch.compile (aot_eager and inductor) an in-place write
        # into a 0-d float64 graph input is silently dropped (float32, float16 and
        # int64 are kept); written through a 1-element view it is kept.
        return dst.view(1).copy_(src.reshape(1))
    return dst.copy_(src)


def copy_into(dst: Any, src: Any) -> None:
    """``dst.copy_(src)`` leaf by leaf (dict entries matched by key); traceable."""
    _compat.tree_map(_copy, dst, src)


# Whether sigint_held is in force in this context: a block inside another holds
# nothing more (one handler swap in and one out per eager training step).
_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("funcgrad_sigint_held", default=False)


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) until the block is done, then deliver it.

    Delivered as the handler in force would have: a Python handler is called (the
    default one raises ``KeyboardInterrupt``), ``SIG_DFL`` ends the process, ``SIG_IGN``
    drops it. Only the main thread receives signals in Python, and only it may set
    handlers; elsewhere, or under a handler installed outside Python (which could not
    be put back), this holds nothing. Inside another such block it holds nothing more:
    the outer one delivers.
    """
    if threading.current_thread() is not threading.main_thread() or _HELD.get():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:
        yield
        return
    caught: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    token = _HELD.set(True)
    try:
        yield
    finally:
        _HELD.reset(token)
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])
        elif caught and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def commit(dst: Any, src: Any, add_to: Sequence[Tensor] = (), add: Sequence[Tensor] = ()) -> None:
    """Write every tensor of ``src`` into the matching one of ``dst``, all or nothing.

    One ``torch._foreach_copy_`` over all leaves (dict entries matched by key), with
    Ctrl-C held back until it is done: an interrupted training step is either not
    applied at all or applied whole. With ``add_to`` and ``add`` (parameters and their
    updates in the parameters' dtypes), ``add_to[i] += add[i]`` in the same block: what
    ``apply_updates`` and a copy would write, bit for bit, in one pass. Eager code
    only (after the compiled step ran).
    """
    into, spec = optree.tree_flatten(dst, none_is_leaf=True, namespace=BUFFERS)
    # optree walks in C++ (dict entries matched by key); torch's pytree, in Python, was
    # a measurable share of the eager step (docs/compile-notes.md)
    pairs: list[tuple[Any, Any]] = [
        (d, s) for d, s in zip(into, spec.flatten_up_to(src), strict=True) if d is not s
    ]
    if not pairs and not add_to:
        return
    with sigint_held(), torch.no_grad():
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        if add_to:
            torch._foreach_add_(list(add_to), list(add))


def names_mismatch(
    expected: Iterable[str], got: Iterable[str], show: Callable[[list[str]], str] = str
) -> str:
    """``"missing [...]; unexpected [...]"``: the one wording for two name sets that
    should be equal (parameters, labels, masks, checkpoint paths)."""
    exp, have = list(expected), list(got)
    exp_set, have_set = set(exp), set(have)
    missing = [n for n in exp if n not in have_set]
    extra = [n for n in have if n not in exp_set]
    return f"missing {show(missing)}; unexpected {show(extra)}"
