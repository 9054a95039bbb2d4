"""The training step: ``fg.make_step`` (``_step``; its gradient functions in
``_gradients``, ``compile="async"`` in ``_async``), ghost clipping (``_ghost``; its
global hooks in ``_ghost_tap``, its watch over parameter uses in ``_ghost_watch``;
each module type's norms and sums in ``_ghost_layers`` and ``_ghost_attention``), what
it checks before tracing (``_checks``) and per-sample gradients (``_per_sample``).
The layer above ``io``: it takes transformations through ``funcgrad.core``'s protocol
and modules through ``funcgrad.model`` (``fg.params``, ``fg.call``, the explained
errors). The public names are ``fg.*``.
"""
