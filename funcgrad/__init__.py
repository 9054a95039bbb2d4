"""funcgrad: pure, compilable per-group gradient rules for PyTorch.

Gradients come from ``torch.func.grad`` over ``functional_call`` parameter dicts,
are grouped by module, transformed by pure branch-free rules, and fed to a
functional Adam - one graph under ``torch.compile(fullgraph=True)``.

Examples:
    >>> import torch, funcgrad as fg
    >>> model = torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    >>> tx = fg.chain(fg.per_group(fg.rules.zero_fix(), fg.group_by_module(model)), fg.adam())
    >>> loss = lambda p, x: fg.call(model, p, x).sum()
    >>> params = fg.params(model)
    >>> params, state, l = fg.make_step(loss, tx)(params, tx.init(params), torch.rand(3, 1))
"""

from . import hooks as hooks
from . import rules as rules
from ._accumulate import AccumulateState as AccumulateState
from ._accumulate import accumulate as accumulate
from ._adafactor import AdafactorState as AdafactorState
from ._adafactor import adafactor as adafactor
from ._adam import AdamState as AdamState
from ._adam import adam as adam
from ._adam import adamw as adamw
from ._base import EmptyState as EmptyState
from ._base import GradientTransformation as GradientTransformation
from ._base import Params as Params
from ._base import apply_updates as apply_updates
from ._base import identity as identity
from ._base import set_to_zero as set_to_zero
from ._base import stateless as stateless
from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import save_checkpoint as save_checkpoint
from ._combine import ChainState as ChainState
from ._combine import PartitionState as PartitionState
from ._combine import chain as chain
from ._combine import named_chain as named_chain
from ._combine import partition as partition
from ._dist import all_reduce_mean as all_reduce_mean
from ._flat import Flat as Flat
from ._groups import Groups as Groups
from ._groups import group_by_module as group_by_module
from ._hparams import get_lr as get_lr
from ._hparams import set_lr as set_lr
from ._lion import LionState as LionState
from ._lion import lion as lion
from ._migrate import adam_state_from_torch as adam_state_from_torch
from ._migrate import adam_state_to_torch as adam_state_to_torch
from ._model import buffers as buffers
from ._model import call as call
from ._model import load_params as load_params
from ._model import params as params
from ._muon import MuonState as MuonState
from ._muon import muon as muon
from ._noise import AddNoiseState as AddNoiseState
from ._noise import add_noise as add_noise
from ._nonfinite import SkipIfNonfiniteState as SkipIfNonfiniteState
from ._nonfinite import skip_if_nonfinite as skip_if_nonfinite
from ._optimizer import Optimizer as Optimizer
from ._per_sample import per_sample_grads as per_sample_grads
from ._rmsprop import AdagradState as AdagradState
from ._rmsprop import RMSpropState as RMSpropState
from ._rmsprop import adagrad as adagrad
from ._rmsprop import rmsprop as rmsprop
from ._schedules import cosine_decay as cosine_decay
from ._schedules import join_schedules as join_schedules
from ._schedules import linear_schedule as linear_schedule
from ._schedules import warmup_cosine_decay as warmup_cosine_decay
from ._sgd import SGDState as SGDState
from ._sgd import sgd as sgd
from ._shard import ShardedState as ShardedState
from ._shard import sharded as sharded
from ._state import load_state_dict as load_state_dict
from ._state import state_dict as state_dict
from ._step import make_step as make_step
from ._torch_state import state_from_torch as state_from_torch
from ._torch_state import state_to_torch as state_to_torch
from ._transforms import MonitorState as MonitorState
from ._transforms import clip_by_global_norm as clip_by_global_norm
from ._transforms import monitor as monitor
from ._transforms import per_group as per_group

__version__ = "0.1.0"
