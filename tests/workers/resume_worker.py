"""Run part of a training in its own process, for the checkpoint/resume test.

python resume_worker.py save  K PATH   # K steps from scratch, save params+state
python resume_worker.py resume N PATH  # load from PATH, run to step N, save params
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import funcgrad as fg


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].bias.fill_(-5.0)  # a dead layer: the rule fires
    groups = fg.group_by_module(model)
    tx = fg.chain(
        fg.monitor(groups),
        fg.per_group(fg.rules.zero_fix(), groups),
        fg.add_noise(1e-3, seed=5),
        fg.skip_if_nonfinite(fg.adamw(lr=fg.cosine_decay(1e-2, 50), amsgrad=True)),
    )

    def loss(p, x, y):
        return ((fg.call(model, p, x) - y) ** 2).mean()

    return model, tx, fg.make_step(loss, tx, donate=True)


def batch(i: int):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(16, 3, generator=g)
    y = torch.randn(16, 1, generator=g)
    if i == 3:
        x[0, 0] = float("nan")  # one non-finite step, to be skipped
    return x, y


def run(params, state, step, start: int, stop: int):
    for i in range(start, stop):
        params, state, _ = step(params, state, *batch(i))
    return params, state


def main() -> None:
    mode, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model, tx, step = setup()
    if mode == "save":
        params = fg.params(model)
        params, state = run(params, tx.init(params), step, 0, n)
        torch.save({"params": params, "state": fg.state_dict(state), "k": n}, path)
    else:
        ckpt = torch.load(path, weights_only=True)
        fg.load_params(model, ckpt["params"])
        params = fg.params(model)
        state = fg.load_state_dict(tx, params, ckpt["state"])
        params, state = run(params, state, step, ckpt["k"], n)
        torch.save({"params": params, "state": fg.state_dict(state)}, path + ".final")


if __name__ == "__main__":
    main()
