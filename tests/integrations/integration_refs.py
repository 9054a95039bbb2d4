"""What both framework tests share: the seed model with a dead layer, the seed rule with
monitor and AdamW, and the reference — the same steps run by hand with fg.Optimizer."""

from __future__ import annotations

import torch
from torch import nn

import funcgrad as fg

STEPS = 6


class DeadSeed(nn.Module):
    """The seed model (1 -> 2 -> 3 -> 1, ReLUs) with the input also added to fc2's input,
    so the result depends on the data although fc1 is dead."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 2)
        self.fc2 = nn.Linear(2, 3)
        self.fc3 = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)) + x)))


def dead_model() -> DeadSeed:
    """float64; fc1 is dead (all its grads exactly zero), fc2 and fc3 partly, so the seed
    rule takes both branches every step."""
    torch.manual_seed(3)
    m = DeadSeed().double()
    with torch.no_grad():
        m.fc1.bias.fill_(-10.0)
        m.fc1.weight.fill_(0.5)
    return m


def named_seed_tx(model: nn.Module, lr: float = 1e-2) -> fg.GradientTransformation:
    groups = fg.group_by_module(model)
    return fg.named_chain(
        ("monitor", fg.monitor(groups)),
        ("rule", fg.per_group(fg.rules.zero_fix(), groups)),
        ("adam", fg.adamw(lr=lr, weight_decay=0.1)),
    )


def seed_objective(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.mean(torch.square(5.0 - net(x.reshape(-1, 1)).sum()))


def batch(i: int) -> torch.Tensor:
    """Step i's whole batch (3 inputs in [0, 1))."""
    g = torch.Generator().manual_seed(100 + i)
    return torch.rand(3, 1, generator=g, dtype=torch.float64)


def batches() -> torch.utils.data.DataLoader:
    """The steps' batches, in order, one per step (``batch_size=None``: no collation)."""
    return torch.utils.data.DataLoader([batch(i) for i in range(STEPS)], batch_size=None)


def by_hand() -> tuple[nn.Module, fg.Optimizer]:
    """The reference: the same steps, a plain loop around fg.Optimizer and the scheduler."""
    net = dead_model()
    opt = fg.Optimizer(net, named_seed_tx(net))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    for i in range(STEPS):
        opt.zero_grad()
        seed_objective(net, batch(i)).backward()
        opt.step()
        sched.step()
    return net, opt
