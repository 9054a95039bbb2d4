"""Transformations that are not optimizers: gradient accumulation (``_accumulate``),
skipping non-finite steps (``_nonfinite``), Gaussian noise (``_noise``) and global-norm
clipping (``_clip``). Imports ``funcgrad.core``, ``funcgrad.step`` and
``funcgrad.rules``. The public names are ``fg.*``.
"""
