"""fg.ghost_clip on vision models nobody here wrote: timm's ViT, DeiT (distilled) and
ConvNeXt, torchvision's ViT (nn.MultiheadAttention), ResNet-18 and MobileNetV3 (eval-mode
BatchNorm, depthwise convolutions), random weights, small inputs, float64: equal to the
vmap path and to a loop over samples. Which rule each module takes is checked too: a
root that owns ``cls_token``/``pos_embed`` (timm, torchvision) or a block that owns its
layer scale (ConvNeXt) reruns only its own code.

torchvision's ViT calls nn.MultiheadAttention with need_weights=False: its own rule.

timm and torchvision load only beside the torch they were built for: ``make test-newest``
installs them (constraints.txt pins them for torch 2.14.1); elsewhere this file skips.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from references import clipped_loop
from torch import nn

import funcgrad as fg
from funcgrad.step import _ghost, _ghost_layers
from funcgrad.step._ghost import ghost_gradients

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

C = 1e-3  # below every sample's norm at these scales: every sample is clipped


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    small = dict(pretrained=False, img_size=32, patch_size=4, num_classes=10, depth=2)
    if name == "timm-vit":
        return timm.create_model("vit_tiny_patch16_224", **small)
    if name == "timm-deit-distilled":
        return timm.create_model("deit_tiny_distilled_patch16_224", **small)
    if name == "timm-convnext":
        return timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    if name == "torchvision-vit":
        return torchvision.models.VisionTransformer(
            image_size=32, patch_size=4, num_layers=2, num_heads=3, hidden_dim=48,
            mlp_dim=96, num_classes=10,
        )  # fmt: skip
    if name == "torchvision-resnet18":
        return torchvision.models.resnet18(num_classes=10)
    return torchvision.models.mobilenet_v3_small(num_classes=10)


# name -> the modules whose per-sample gradients come from a vmap: (class, narrow)
FALLBACKS = {
    "timm-vit": {("VisionTransformer", True), ("LayerNorm", False)},
    "timm-deit-distilled": {("VisionTransformerDistilled", True), ("LayerNorm", False)},
    "timm-convnext": {("ConvNeXtBlock", True), ("LayerNorm2d", False)},
    "torchvision-vit": {("VisionTransformer", True), ("Encoder", True)},
    "torchvision-resnet18": set(),
    "torchvision-mobilenet": set(),
}


def _loss(model):
    def loss(p, x, y):
        out = fg.call(model, p, x)
        return nn.functional.cross_entropy(out[0] if isinstance(out, tuple) else out, y)

    return loss


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_ghost_clip_equals_the_vmap_path_and_a_loop_on_vision_models(name, monkeypatch):
    model = _model(name).double().eval()  # dropout off, BatchNorm from running stats
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=g)
    params = fg.params(model).views()
    taken: list = []
    real = _ghost.layer_of
    monkeypatch.setattr(_ghost, "layer_of", lambda c, n: taken.append(real(c, n)) or taken[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback over the whole model
        warnings.filterwarnings("ignore", message=".*batching rule.*")  # torch's own
        got, _, _, _ = ghost_gradients(_loss(model), False, C, "mean")(params, x, y)
    fallbacks = {
        (type(t.call.module).__name__, t.narrow)
        for t in taken
        if isinstance(t, _ghost_layers.Vmapped)
    }
    assert fallbacks == FALLBACKS[name]
    scale = max(v.abs().max() for v in got.values())
    step = fg.make_step(_loss(model), fg.sgd(lr=1.0), per_sample=fg.clip_by_global_norm(C))
    p = {k: v.clone() for k, v in params.items()}
    new, _, _ = step(p, fg.sgd(lr=1.0).init(p), x, y)
    for k in got:  # sgd(lr=1): p - new is the gradient (to the rounding of p's entries)
        tol = 1e-12 * scale + 1e-15 * p[k].abs().max()
        torch.testing.assert_close(got[k], p[k] - new[k], rtol=0, atol=tol, msg=k)
    loop, _ = clipped_loop(_loss(model), params, x, y, C)
    for k in got:
        torch.testing.assert_close(got[k], loop[k], rtol=0, atol=1e-12 * scale, msg=k)
