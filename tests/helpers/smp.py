"""Helpers for the smp family's tests: presets as seg-train composes them, lively weights."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from seg_at_scale.models.registry import build_model
from seg_at_scale.models.smp import SMPModel

CONF = str(Path(__file__).resolve().parents[2] / "seg_at_scale" / "conf")
TEST_PRESETS = ["unet_test_resnet", "fpn_test_resnet", "deeplabv3plus_test_resnet"]
ALL_PRESETS = sorted(p.stem for p in (Path(CONF) / "model").glob("*.yaml")
                     if "model_family@_here_: smp" in p.read_text())


def model_node(preset: str, *overrides: str, bands: int = 4, classes: int = 5) -> dict:
    """The ``model`` node of ``seg-train model=<preset>`` (resolved, plain data; a copy)."""
    return copy.deepcopy(_composed(preset, overrides, bands, classes))


@functools.cache
def _composed(preset: str, overrides: tuple[str, ...], bands: int, classes: int) -> dict:
    """Composed once per process (Hydra's compose: ~0.1 s each)."""
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"model={preset}", f"data.bands={bands}",
                                          f"data.num_classes={classes}", *overrides])
    return OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[return-value]


def preset_model(preset: str, *overrides: str, bands: int = 4, classes: int = 5,
                 seed: int = 0) -> SMPModel:
    """A preset built through the registry, with lively weights, in eval mode."""
    torch.manual_seed(seed)
    net = build_model(model_node(preset, *overrides, bands=bands, classes=classes),
                      where="test")
    return lively(net)  # type: ignore[return-value]


def lively_norms(net: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Every BatchNorm with running statistics and an affine part far from the identity,
    then eval (a freshly built BatchNorm computes the identity in eval)."""
    torch.manual_seed(seed)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 2)
            m.bias.data.uniform_(-1, 1)
    return net.eval()


def lively(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """BatchNorm statistics as after training and spread logits (an untrained head makes
    every pixel one class, which would let a label comparison pass trivially)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
        head = net.net.segmentation_head[0]
        head.weight.mul_(5.0)
    return net.eval()


def assert_exact(tiled: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    """fp32 logits within ``tol`` (relative to the largest) and identical labels wherever
    the reference is not a tie within that float noise (as tests/tiling/test_exact_tiling.py)."""
    assert tiled.shape == ref.shape
    labels = ref.argmax(1)
    assert labels.unique().numel() > 1  # a non-trivial labelling
    scale = float(ref.abs().max())
    assert float((tiled - ref).abs().max()) <= tol * scale
    top2 = ref.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > tol * scale
    assert decided.float().mean() > 0.999
    assert torch.equal(tiled.argmax(1)[decided], labels[decided])
