import pytest
import pytorch_lightning as pl
import torch
from helpers.data import tiff_module

from seg_at_scale.models import UNet
from seg_at_scale.tasks import SegmentationTask, poly_lr


def test_poly_lr_decays_to_zero_after_warmup():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
    sched = poly_lr(opt, total_steps=100, power=0.9, warmup_steps=10)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.001 and abs(lrs[9] - 0.01) < 1e-12
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert abs(opt.param_groups[0]["lr"]) < 1e-12


def test_grid_mode_steps_once_per_image_on_the_whole_image_gradient(tmp_path, scene_files):
    for k in range(2):
        scene_files(tmp_path / "train", name=f"s{k}", shape=(3, 83, 97), seed=k)
    scene_files(tmp_path / "val", name="v", shape=(3, 83, 97), seed=9)
    torch.manual_seed(0)
    net = UNet(3, 5, levels=2, base_width=4, padding="same")
    dm = tiff_module(tmp_path, net.footprint(), 5, tiling="grid", q=2)
    steps = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            steps.append(trainer.global_step)

    task = SegmentationTask(net, 5, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            gradient_reduction="sum")
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Count()],
                         num_sanity_val_steps=0, accelerator="cpu")
    trainer.fit(task, datamodule=dm)
    assert len(steps) == 8  # 2 images x 4 tiles
    assert steps == [0, 0, 0, 1, 1, 1, 1, 2]  # the optimiser steps on each image's last tile
    # the scheduler's horizon is those steps: one per image, not one per tile
    assert dm.optimizer_steps_per_epoch() == steps[-1] == task._optimizer_steps() == 2
    assert 0.0 <= float(trainer.callback_metrics["val/miou"]) <= 1.0


def test_the_learning_rate_schedule_ends_with_the_batches_lightning_runs(tmp_path, scene_files):
    """Random tiles with ``limit_train_batches`` (trainer=fast): before, the schedule's
    horizon was every batch of the epochs (8 per epoch here: 24 steps), so after the run's 6 steps
    the rate had hardly decayed."""
    from seg_at_scale.tasks.segmentation import poly_lr

    for k in range(2):
        scene_files(tmp_path / "train", name=f"s{k}", shape=(3, 83, 97), seed=k)
    scene_files(tmp_path / "val", name="v", shape=(3, 83, 97), seed=9)
    torch.manual_seed(0)
    net = UNet(3, 5, levels=2, base_width=4, padding="same")
    dm = tiff_module(tmp_path, net.footprint(), 5, tiling="random", core_size=32,
                     samples_per_epoch=16, batch_size=2)
    task = SegmentationTask(net, 5, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            scheduler=poly_lr, gradient_reduction="mean")
    trainer = pl.Trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         num_sanity_val_steps=0, accelerator="cpu")
    trainer.fit(task, datamodule=dm)
    assert trainer.global_step == 6 == task._optimizer_steps()
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.0  # (1 - 6 / 6) ** 0.9


def test_frozen_batch_norm_stays_frozen_through_fit(tmp_path, scene_files):
    """Before: ``finetune.freeze_bn=all`` froze only in ``task.train()``, which Lightning's
    fit never calls: every BatchNorm trained, its statistics moved (grid steps with each
    tile's statistics)."""
    for k in range(2):
        scene_files(tmp_path / "train", name=f"s{k}", shape=(3, 83, 97), seed=k)
    scene_files(tmp_path / "val", name="v", shape=(3, 83, 97), seed=9)
    torch.manual_seed(0)
    net = UNet(3, 5, levels=2, base_width=4, padding="same", norm="batch")
    before = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    dm = tiff_module(tmp_path, net.footprint(), 5, tiling="grid", q=2)
    modes = []

    class Modes(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            modes.append({m.training for m in module.modules()
                          if isinstance(m, torch.nn.BatchNorm2d)})

    task = SegmentationTask(net, 5, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            gradient_reduction="sum", freeze_bn="all")
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Modes()],
                         num_sanity_val_steps=0, accelerator="cpu")
    trainer.fit(task, datamodule=dm)
    assert len(modes) == 16 and all(m == {False} for m in modes)  # both epochs, after val
    after = net.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_a_class_absent_from_validation_is_left_out_of_val_miou(monkeypatch):
    """Before: torchmetrics gave a class with no pixel in target or prediction IoU 0, so
    val/miou was 0.665 where the test scene's mIoU (absent classes left out) was 0.998."""
    import math

    task = SegmentationTask(UNet(3, 3, levels=2, base_width=4), 3, gradient_reduction="sum")
    logged = {}
    monkeypatch.setattr(task, "log", lambda name, value, **kw: logged.__setitem__(
        name, float(value)))
    # class 0: 2 of 3 pixels (IoU 2/3); class 1: 1 hit, 1 false (1/2); class 2: nowhere
    task.val_iou.update(torch.tensor([[0, 1, 1, 0]]), torch.tensor([[0, 1, 0, 0]]))
    task.on_validation_epoch_end()
    assert logged["val/miou"] == pytest.approx((2 / 3 + 1 / 2) / 2, rel=1e-6)
    assert math.isnan(logged["val/iou_class_2"])
