"""The training step: ``fg.make_step`` (``_step``), what it checks before tracing
(``_checks``), its explained errors (``_errors``), per-sample gradients (``_per_sample``)
and the way between an ``nn.Module`` and dicts of tensors (``_model``: ``fg.params``,
``fg.call``). Imports only ``funcgrad.core``. The public names are ``fg.*``.
"""
