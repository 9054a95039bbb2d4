"""Ghost clipping's watch over the parameters' uses (``_ghost._probe``, eagerly).

Ghost clipping sees a parameter through the calls of the module that owns it (or, for
a parameter no call of its module reaches, through the smallest called module holding
it: ``nn.MultiheadAttention`` reads ``out_proj.weight``). A use anywhere else would be
left out of every sample's gradient without a word, so the first probe of each input
signature runs under :class:`DirectReads`, which sees every operation on a trained
parameter and where in the module calls it happens.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._compat import tree_flatten
from . import _ghost_tap as tap

_NOT_A_USE = ("detach", "detach_", "requires_grad_", "data", "grad")
"""Reads of a parameter that do not differentiate through it (by name; ``data`` and
``grad`` are attribute reads)."""


class DirectReads(TorchFunctionMode):
    """During an eager probe pass: the trained parameters an operation uses outside the
    forward of the module that owns them. ``outside``: read where no call of the owner
    is in progress (in the loss, by a sibling or an ancestor), with the module whose
    forward read it (None: the loss) and the path of the parameter's owner in it (None:
    not in it); ``within``: the owners whose parameters a call
    they make reads (not through its arguments' taps); ``called``: the modules whose
    calls ran operations."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[int, str] = {}  # id(tensor) -> name: set per pass (_ghost._pass_shapes)
        self.outside: dict[str, tuple[nn.Module | None, str | None]] = {}  # reader, path
        self.within: set[int] = set()  # id(owner module)
        self.called: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _NOT_A_USE or not any(isinstance(t, Tensor) for t in tree_flatten(out)[0]):
            return out
        frames = [f for f in tap._TAP.stack if f is not None]
        self.called.update(id(f.module) for f in frames)
        for t in tree_flatten((args, kwargs))[0]:
            param = self.ids.get(id(t)) if isinstance(t, Tensor) else None
            if param is None:
                continue
            owner = next(
                (i for i, f in enumerate(frames)
                 if any(v is t for v in f.module._parameters.values())),
                None,
            )  # fmt: skip
            if owner is None:
                if param in self.outside:
                    continue
                reader = frames[-1].module if frames else None
                path = None if reader is None else next(  # while its tensors are swapped in
                    (p for p, m in reader.named_modules()
                     if any(v is t for v in m._parameters.values())),
                    None,
                )  # fmt: skip
                self.outside[param] = (reader, path)
            elif owner != len(frames) - 1:
                self.within.add(id(frames[owner].module))
        return out

    def refuse(self, reached: set[str]) -> None:
        """Raise where a read would be left out: a parameter its module's calls reach
        and other code reads too, or one no call reaches whose reader is not the
        smallest called module holding it (the one its per-sample gradient comes from)."""
        for param, (reader, path) in sorted(self.outside.items(), key=lambda kv: kv[0]):
            where = "the loss" if reader is None else type(reader).__name__
            if param in reached:
                raise ValueError(
                    f"fg.ghost_clip: parameter '{param}' is used by the calls of the module "
                    f"that owns it and also read directly by {where} (an operation on the "
                    "parameter outside that module's forward, such as a tied output head "
                    "written as h @ emb.weight.T). Ghost clipping sees a parameter through "
                    "its module's calls, so that use's share of each sample's gradient "
                    "would be missing. Call the module instead (an nn.Linear whose weight "
                    "is the embedding's), or use per_sample=fg.clip_by_global_norm(max_norm)."
                )
            if reader is None:
                continue  # no module call reaches it: _ghost's "not used by any" error
            parts = [] if path is None else path.split(".")
            between = [reader.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
            if path is None or path == "" or any(id(m) in self.called for m in between):
                raise ValueError(
                    f"fg.ghost_clip: parameter '{param}' is read directly by {where}, and no "
                    "call of its own module reaches it; ghost clipping then takes its "
                    "per-sample gradients from the smallest called module holding it, "
                    f"which is not {where}, so that read would be missing. Read it in the "
                    "module that holds it, call its module, or use "
                    "per_sample=fg.clip_by_global_norm(max_norm)."
                )
