"""The optimizers, one file each (``_adam`` for Adam and AdamW, ``_sgd``, ``_rmsprop``,
``_adagrad``, ``_adafactor``, ``_muon``, ``_lion``, ...), over one kernel builder
(``_kernel``; its elementwise operations in ``_ops``); their hyperparameters
(``_hparams``: learning rates as state, checks, decay masks; ``_get_set``:
``fg.get_hyperparams`` and its siblings) and schedules (``_schedules``);
``fg.Optimizer``'s eager step on torch's fused kernels (``_fused``) and foreach
implementations (``_foreach``). Imports ``funcgrad.core`` and
``funcgrad.rules``. The public names are ``fg.*``.
"""
