"""Fine-tuning: frozen BatchNorm keeps a tiled step exact; frozen epochs; encoder lr."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers.smp import CONF, preset_model
from hydra import compose, initialize_config_dir

from seg_at_scale.errors import ConfigError
from seg_at_scale.models import UNet
from seg_at_scale.tasks import SegmentationTask
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import extend
from seg_at_scale.tiling.statistic_passes import tiled_backward_exact

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def task_of(net, **kw) -> SegmentationTask:
    opt = kw.pop("optimizer", lambda p: torch.optim.SGD(p, lr=0.1))
    return SegmentationTask(net, 5, optimizer=opt, gradient_reduction="sum", **kw)


def step(task: SegmentationTask, x, target, tiled: bool) -> dict[str, torch.Tensor]:
    """One optimiser step on the whole image's loss; the parameters after it."""
    net = task.model
    task.train()
    opt = task.configure_optimizers()
    opt.zero_grad()
    loss = CrossEntropy(5)
    if tiled:
        tiled_backward_exact(net, x, target, loss, q=2)
    else:
        fp = net.footprint()
        s, w = loss(net(extend(x, fp))[..., : x.shape[-2], : x.shape[-1]], target)
        (s / w).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()
            if "running" in k or k in dict(net.named_parameters())}


@pytest.mark.parametrize("freeze_bn,exact", [("all", True), ("none", False)])
def test_frozen_bn_finetuning_step_tiled_equals_untiled(freeze_bn, exact):
    torch.manual_seed(0)
    x = torch.randn(1, 4, 389, 357, dtype=torch.float64)
    target = torch.randint(0, 5, (1, 389, 357))
    after = []
    for tiled in (False, True):
        net = preset_model("unet_test_resnet").double()
        after.append(step(task_of(net, freeze_bn=freeze_bn), x, target, tiled))
    worst = max(float((after[0][k] - after[1][k]).abs().max()) for k in after[0])
    assert (worst < 1e-9) == exact  # train-mode BatchNorm sees each tile's statistics


def test_batch_norm_stays_frozen_through_lightning_train_calls():
    net = preset_model("unet_test_resnet")
    task = task_of(net, freeze_bn="encoder")
    task.train()
    enc = [m for m in net.net.encoder.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    dec = [m for m in net.net.decoder.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert enc and dec and not any(m.training for m in enc) and all(m.training for m in dec)


def test_encoder_frozen_for_the_first_epochs_then_trained():
    net = preset_model("unet_test_resnet")
    task = task_of(net, freeze_encoder_epochs=2)
    first = next(net.encoder_parameters())
    before = first.detach().clone()
    with mock.patch.object(SegmentationTask, "current_epoch", new_callable=mock.PropertyMock,
                           return_value=1):
        task.on_train_epoch_start()
    assert not any(p.requires_grad for p in net.encoder_parameters())
    opt = torch.optim.AdamW([p for p in net.parameters()], lr=0.1, weight_decay=0.1)
    net.train()(torch.randn(1, 4, 64, 64)).sum().backward()
    opt.step()
    assert torch.equal(first, before)  # weight decay too: a parameter without grad is left
    with mock.patch.object(SegmentationTask, "current_epoch", new_callable=mock.PropertyMock,
                           return_value=2):
        task.on_train_epoch_start()
    assert all(p.requires_grad for p in net.encoder_parameters())


def test_encoder_learning_rate_is_scaled():
    import functools

    net = preset_model("unet_test_resnet")
    task = task_of(net, encoder_lr_scale=0.1,
                   optimizer=functools.partial(torch.optim.AdamW, lr=3e-3))
    groups = task.configure_optimizers().param_groups
    assert [g["lr"] for g in groups] == [3e-3, pytest.approx(3e-4)]
    assert sum(p.numel() for p in groups[1]["params"]) == sum(
        p.numel() for p in net.encoder_parameters())


def test_finetune_keys_refused_for_a_model_without_encoder():
    with pytest.raises(ConfigError, match="need a model with a pretrained encoder"):
        task_of(UNet(4, 5, levels=3, base_width=4, padding="same"), freeze_encoder_epochs=1)
    with pytest.raises(ConfigError, match="finetune.freeze_bn='some'"):
        task_of(preset_model("unet_test_resnet"), freeze_bn="some")


def test_experiment_finetune_composes():
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=finetune", "model=unet_test_resnet"])
    assert (cfg.task.freeze_bn, cfg.task.freeze_encoder_epochs, cfg.task.encoder_lr_scale) == (
        "all", 2, 0.1)
    assert cfg.tiling.mode == "grid" and cfg.model.encoder == "tu-test_resnet"


def test_optuna_space_searches_architecture_and_encoder():
    from seg_at_scale.sweeps.space import search_space

    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=optuna_smp"],
                      return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    space = search_space(dict(sweeper.params), conditions=dict(sweeper.conditions))
    names = {p.name: p for p in space.params}
    assert names["model.arch"].choices == ("Unet", "FPN", "DeepLabV3Plus")
    assert "tu-convnext_tiny" in names["model.encoder"].choices
    assert names["finetune.encoder_lr_scale"].log and "memory" not in names
    assert "model=smp" in space.fixed


def test_pipelines_without_a_flat_form_are_refused_with_the_reason():
    from seg_at_scale.parallel.setup import resolve_pipeline

    net = preset_model("unet_test_resnet")
    with pytest.raises(ConfigError, match="SMPModel has no flat layer form"):
        resolve_pipeline({"mode": "auto", "stages": 2}, net, (4, 64, 64), 2)
