"""The core: what a gradient transformation is, and what everything else builds on.

``_base`` (``GradientTransformation``, ``identity``, ``stateless``, ``apply_updates``),
``_combine`` (``chain``, ``named_chain``, ``partition``), ``_tree`` (walking state
trees), ``_flat`` (``fg.Flat``, the flat layout of params, gradients and state) and
``_layout`` (where each of its entries lies, and how a module is cut into buffers),
``_compose`` (when an update takes its plain, differentiable math), ``_invariants``
(what each state type always satisfies), ``_scratch`` and ``_fusion`` (eager buffers,
inductor fusion hints). Imports nothing else of funcgrad but ``funcgrad._compat``.
The public names are ``fg.*`` (``funcgrad/__init__.py``).
"""
