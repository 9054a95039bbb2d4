"""Data-parallel and sharded training: ``fg.all_reduce_mean`` (``_all_reduce``),
``fg.sharded`` (ZeRO-2, ``_sharded``) and distributed checkpoints (``_checkpoint``:
directories written with ``torch.distributed.checkpoint``, imported on first use, and
a sharded state's rows viewed whole). Imports ``funcgrad.core`` and ``funcgrad.rules``.
The public names are ``fg.*``.
"""
