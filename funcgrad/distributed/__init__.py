"""Data-parallel and sharded training: ``fg.all_reduce_mean`` (``_all_reduce``),
``fg.sharded`` (ZeRO-2, ``_sharded``; how it cuts tensors across ranks in ``_split``)
and distributed checkpoints (``_checkpoint``: directories written with
``torch.distributed.checkpoint``, imported on first use; a sharded state's rows viewed
whole in ``_whole``; atomic writes and checksums in ``_files``). Imports
``funcgrad.core`` and ``funcgrad.rules``. The public names are ``fg.*``.
"""

from .. import _compat

# Before any process group, as `import funcgrad` comes first in a script: torch's
# defaults that would otherwise pin the world group (funcgrad/_compat.py).
_compat.import_distributed_nn_early()
