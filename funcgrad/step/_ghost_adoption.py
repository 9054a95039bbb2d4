"""Ghost clipping's adoptions: a module called without the batch whose output cannot take
it, given to the module that calls it (found by ``_ghost._probe``, read by the hooks of
``_ghost_tap``)."""

from __future__ import annotations

from torch import nn


class Adoption:
    """Calls made without the batch whose output cannot take it (T5's relative position
    bias: an embedding on a ``(T, T)`` grid, then permuted), each given to the module
    whose call made it: that module's call owns the adopted module's trained
    parameters (``relative_attention_bias.weight``), and their per-sample gradients come
    from its vmap fallback (``_ghost_layers.Vmapped``), which reruns its whole subtree.
    Found by the shape probe (``_ghost._probe``), kept by the ghost step and with each
    plan it caches."""

    def __init__(self) -> None:
        self.adopted: dict[int, list[tuple[str, nn.Module]]] = {}  # id(adopter): children
        self.given: dict[int, nn.Module] = {}  # id(adopted module): its adopter

    def plus(self, child: nn.Module, parent: nn.Module) -> Adoption:
        """These adoptions and ``parent``'s of ``child`` (a new object: a probe in
        another thread keeps the ones it started with)."""
        path = next(p for p, m in parent.named_modules(remove_duplicate=False) if m is child)
        out = Adoption()
        out.given = {**self.given, id(child): parent}
        out.adopted = {k: list(v) for k, v in self.adopted.items()}
        out.adopted.setdefault(id(parent), []).append((path, child))
        return out

    def check(self, child: nn.Module, caller: nn.Module | None) -> None:
        """An adopted module called by another than its adopter: that use would be missing
        from the adopter's per-sample gradients."""
        parent = self.given[id(child)]
        if caller is not parent:
            raise ValueError(
                f"fg.ghost_clip: the module {type(child).__name__} runs without the batch "
                f"and its output cannot take it, so its per-sample gradients come from the "
                f"module that calls it ({type(parent).__name__}); it is also called by "
                f"{'the loss' if caller is None else type(caller).__name__}, whose share of "
                "each sample's gradient would be missing. Call it from one module only, "
                "freeze its parameters, or use per_sample=fg.clip_by_global_norm(max_norm)."
            )
