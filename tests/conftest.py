"""Shared fixtures: the seed model, and a checker that runs a function eagerly and
under torch.compile(fullgraph=True), asserting equal results and one graph."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from references import SeedModel

# tests/integrations/ needs ``funcgrad[integrations]`` (Lightning, transformers): it runs
# from ``make test-integrations`` (FUNCGRAD_INTEGRATIONS=1), not from ``make test``.
collect_ignore_glob = [] if os.environ.get("FUNCGRAD_INTEGRATIONS") else ["integrations/*"]

# ``make test-fast`` (FUNCGRAD_FAST=1): a test skips where it would call torch.compile,
# so the edit loop runs the eager references only; ``make test`` runs everything.
if os.environ.get("FUNCGRAD_FAST"):

    def _skip_compile(*args: Any, **kwargs: Any) -> Any:
        pytest.skip("compiles: skipped by make test-fast (make test runs it)")

    torch.compile = _skip_compile  # type: ignore[assignment]


@pytest.fixture
def seed_model() -> SeedModel:
    torch.manual_seed(0)
    return SeedModel()


@pytest.fixture
def one_rank():
    """A process group of one rank in this process (gloo), for fg.sharded and
    fg.all_reduce_mean without spawning."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
