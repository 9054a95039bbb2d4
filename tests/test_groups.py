"""group_by_module on nested models, against groups written out by hand."""

from __future__ import annotations

import re

import pytest
import torch
from references import SeedModel
from torch import nn

import funcgrad as fg


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)) for _ in range(2)]
        )
        self.heads = nn.ModuleDict({"cls": nn.Linear(2, 3), "reg": nn.Linear(2, 1, bias=False)})


def test_default_groups_are_owning_modules():
    assert dict(fg.group_by_module(SeedModel())) == {
        "fc1": ("fc1.weight", "fc1.bias"),
        "fc2": ("fc2.weight", "fc2.bias"),
        "fc3": ("fc3.weight", "fc3.bias"),
    }
    groups = fg.group_by_module(Nested())
    assert dict(groups) == {
        "": ("scale",),
        "encoder.layers.0.0": ("encoder.layers.0.0.weight", "encoder.layers.0.0.bias"),
        "encoder.layers.0.1": ("encoder.layers.0.1.weight", "encoder.layers.0.1.bias"),
        "encoder.layers.1.0": ("encoder.layers.1.0.weight", "encoder.layers.1.0.bias"),
        "encoder.layers.1.1": ("encoder.layers.1.1.weight", "encoder.layers.1.1.bias"),
        "heads.cls": ("heads.cls.weight", "heads.cls.bias"),
        "heads.reg": ("heads.reg.weight",),
    }
    # The same from the params dict alone.
    assert fg.group_by_module(fg.params(Nested())) == groups


def test_types_and_depth():
    model = Nested()
    lin = fg.group_by_module(model, types=nn.Linear)
    assert list(lin) == ["encoder.layers.0.0", "encoder.layers.1.0", "heads.cls", "heads.reg"]
    assert "encoder.layers.0.1.weight" not in {n for ns in lin.values() for n in ns}
    d3 = fg.group_by_module(model, depth=3)
    assert d3["encoder.layers.0"] == (
        "encoder.layers.0.0.weight",
        "encoder.layers.0.0.bias",
        "encoder.layers.0.1.weight",
        "encoder.layers.0.1.bias",
    )
    assert d3["heads.cls"] == ("heads.cls.weight", "heads.cls.bias")
    d1 = fg.group_by_module(model, depth=1, types=(nn.Linear,))
    assert list(d1) == ["encoder", "heads"]
    assert len(d1["heads"]) == 3


def test_group_errors():
    with pytest.raises(
        ValueError, match=re.escape("parameter 'a' is in both group 'x' and group 'y'")
    ):
        fg.Groups({"x": ["a"], "y": ["a", "b"]})
    with pytest.raises(ValueError, match=re.escape("group 'x' is empty")):
        fg.Groups({"x": []})
    with pytest.raises(TypeError, match=re.escape("maps to the string 'a.weight'")):
        fg.Groups({"a": "a.weight"})
    groups = fg.group_by_module(SeedModel())
    with pytest.raises(KeyError, match=re.escape("fg.Groups.select: no group named ['fc9']")):
        groups.select("fc9")
    with pytest.raises(
        KeyError,
        match=re.escape("fg.Groups: no group named 'fc9'. Known groups: ['fc1', 'fc2', 'fc3']"),
    ):
        groups["fc9"]
