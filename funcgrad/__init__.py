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
from .core._base import EmptyState as EmptyState
from .core._base import GradientTransformation as GradientTransformation
from .core._base import Params as Params
from .core._base import apply_updates as apply_updates
from .core._base import identity as identity
from .core._base import set_to_zero as set_to_zero
from .core._base import stateless as stateless
from .core._combine import ChainState as ChainState
from .core._combine import ParamGroupsState as ParamGroupsState
from .core._combine import PartitionState as PartitionState
from .core._combine import chain as chain
from .core._combine import named_chain as named_chain
from .core._combine import partition as partition
from .core._flat import Flat as Flat
from .distributed._all_reduce import all_reduce_mean as all_reduce_mean
from .distributed._sharded import ShardedState as ShardedState
from .distributed._sharded import sharded as sharded
from .io._checkpoint import load_checkpoint as load_checkpoint
from .io._checkpoint import save_checkpoint as save_checkpoint
from .io._state_dict import load_state_dict as load_state_dict
from .io._state_dict import state_dict as state_dict
from .io._torch_state import state_from_torch as state_from_torch
from .io._torch_state import state_to_torch as state_to_torch
from .model._model import buffers as buffers
from .model._model import call as call
from .model._model import load_params as load_params
from .model._model import params as params
from .optim._adadelta import AdadeltaState as AdadeltaState
from .optim._adadelta import adadelta as adadelta
from .optim._adafactor import AdafactorState as AdafactorState
from .optim._adafactor import adafactor as adafactor
from .optim._adagrad import AdagradState as AdagradState
from .optim._adagrad import adagrad as adagrad
from .optim._adam import AdamState as AdamState
from .optim._adam import adam as adam
from .optim._adam import adamw as adamw
from .optim._adamax import AdamaxState as AdamaxState
from .optim._adamax import adamax as adamax
from .optim._asgd import ASGDState as ASGDState
from .optim._asgd import asgd as asgd
from .optim._get_set import get_hyperparams as get_hyperparams
from .optim._get_set import get_lr as get_lr
from .optim._get_set import set_hyperparams as set_hyperparams
from .optim._get_set import set_lr as set_lr
from .optim._lbfgs import LBFGSState as LBFGSState
from .optim._lbfgs import lbfgs as lbfgs
from .optim._lion import LionState as LionState
from .optim._lion import lion as lion
from .optim._muon import MuonState as MuonState
from .optim._muon import muon as muon
from .optim._nadam import NAdamState as NAdamState
from .optim._nadam import nadam as nadam
from .optim._param_groups import grouped as grouped
from .optim._radam import RAdamState as RAdamState
from .optim._radam import radam as radam
from .optim._rmsprop import RMSpropState as RMSpropState
from .optim._rmsprop import rmsprop as rmsprop
from .optim._rprop import RpropState as RpropState
from .optim._rprop import rprop as rprop
from .optim._schedule_free import ScheduleFreeAdamWState as ScheduleFreeAdamWState
from .optim._schedule_free import ScheduleFreeSGDState as ScheduleFreeSGDState
from .optim._schedule_free import schedule_free_adamw as schedule_free_adamw
from .optim._schedule_free import schedule_free_eval as schedule_free_eval
from .optim._schedule_free import schedule_free_sgd as schedule_free_sgd
from .optim._schedules import cosine_decay as cosine_decay
from .optim._schedules import join_schedules as join_schedules
from .optim._schedules import linear_schedule as linear_schedule
from .optim._schedules import warmup_cosine_decay as warmup_cosine_decay
from .optim._sgd import SGDState as SGDState
from .optim._sgd import sgd as sgd
from .rules._groups import Groups as Groups
from .rules._groups import group_by_module as group_by_module
from .rules._per_group import MonitorState as MonitorState
from .rules._per_group import monitor as monitor
from .rules._per_group import per_group as per_group
from .step._per_sample import per_sample_grads as per_sample_grads
from .step._step import make_step as make_step
from .torch_optim import Optimizer as Optimizer
from .transforms._accumulate import AccumulateState as AccumulateState
from .transforms._accumulate import accumulate as accumulate
from .transforms._clip import clip_by_global_norm as clip_by_global_norm
from .transforms._clip import ghost_clip as ghost_clip
from .transforms._noise import AddNoiseState as AddNoiseState
from .transforms._noise import add_noise as add_noise
from .transforms._nonfinite import SkipIfNonfiniteState as SkipIfNonfiniteState
from .transforms._nonfinite import skip_if_nonfinite as skip_if_nonfinite

__version__ = "0.1.0"

_REMOVED = {
    "adam_state_from_torch": (
        "fg.adam_state_from_torch was removed (the Adam-only twin of fg.state_from_torch). "
        "Use fg.state_from_torch(tx, optimizer, params) with tx = fg.adam(...) or "
        "fg.adamw(...) built with the optimizer's hyperparameters and params = "
        "dict(model.named_parameters())."
    ),
    "adam_state_to_torch": (
        "fg.adam_state_to_torch was removed (the Adam-only twin of fg.state_to_torch). "
        "Use fg.state_to_torch(tx, state, optimizer, params) with the tx that made the "
        "state and params = dict(model.named_parameters())."
    ),
}


def __getattr__(name: str) -> object:
    """A removed public name: an AttributeError that says what replaces it."""
    if name in _REMOVED:
        raise AttributeError(_REMOVED[name])
    raise AttributeError(f"module 'funcgrad' has no attribute {name!r}")
