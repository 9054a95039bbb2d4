"""The optimizers, one file each (``_adam`` for Adam and AdamW, ``_sgd``, ``_rmsprop``,
``_adagrad``, ``_adafactor``, ``_muon``, ``_lion``), over one kernel builder
(``_kernel``); their hyperparameters (``_hparams``: learning rates as state, checks,
decay masks) and schedules (``_schedules``). Imports ``funcgrad.core`` and
``funcgrad.rules``. The public names are ``fg.*``.
"""
