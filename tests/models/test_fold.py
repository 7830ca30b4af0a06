"""BatchNorm folded into its convolution for prediction: which pairs fold, which must not,
and that ``predict_raster`` runs the folded network (``fold_bn``, default on)."""

from __future__ import annotations

import pytest
import timm.layers
import torch
from helpers.prediction import make_image
from helpers.smp import TEST_PRESETS, assert_exact, lively_norms, model_node, preset_model
from test_smp_files import DATA, check_labels
from torch import nn

from seg_at_scale.errors import OutputExistsError
from seg_at_scale.io import read_raster
from seg_at_scale.models.fold import fold_batchnorm, foldable_pairs
from seg_at_scale.prediction import PredictOptions, predict_raster
from seg_at_scale.tiling import predict_full

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bns(net: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in net.modules())


@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_every_batchnorm_of_the_presets_folds_and_the_logits_stay(preset):
    net = preset_model(preset)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    folded, n = fold_batchnorm(net, torch.zeros(1, 4, 64, 64))
    assert n == _bns(net) > 0 and _bns(folded) == 0
    x = torch.randn(1, 4, 160, 224)
    with torch.no_grad():
        assert_exact(folded(x), net(x))
    after = net.state_dict()  # the model given is unchanged
    assert after.keys() == before.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True)


class _Residual(nn.Module):
    """The convolution's output is also added after the BatchNorm: it must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


class _InPlace(_Residual):
    """An in-place activation between them: the BatchNorm reads a changed tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x).relu_())


class _Shared(nn.Module):
    """One convolution run twice, each time before another BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.a, self.b = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.conv(x)) + self.b(self.conv(x))


@pytest.mark.parametrize(("net", "pairs"), [
    (nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)), [("0", "1")]),
    (_Residual(), []), (_InPlace(), []), (_Shared(), [])])
def test_a_batchnorm_folds_only_when_nothing_else_reads_its_input(net, pairs):
    net = lively_norms(net)
    x = torch.randn(2, 3, 13, 11)
    assert foldable_pairs(net, x) == pairs
    folded, n = fold_batchnorm(net, x)
    assert n == len(pairs)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), net(x), rtol=1e-5, atol=1e-5)


def test_a_train_mode_batchnorm_does_not_fold():
    net = lively_norms(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3))).train()
    assert fold_batchnorm(net, torch.randn(2, 3, 8, 8)) == (net, 0)


def test_timm_batchnorm_act_keeps_its_activation():
    net = lively_norms(timm.layers.ConvNormAct(3, 4, 3, act_layer=nn.ReLU))
    x = torch.randn(1, 3, 9, 10)
    folded, n = fold_batchnorm(net, x)
    assert n == 1 and _bns(folded) == 0
    with torch.no_grad():
        y = folded(x)
        torch.testing.assert_close(y, net(x), rtol=1e-5, atol=1e-5)
    assert float(y.min()) == 0.0  # the ReLU is still there


def test_prediction_runs_the_folded_network_and_records_it(tmp_path, monkeypatch):
    net = preset_model("deeplabv3plus_test_resnet")
    image = make_image(tmp_path / "scene.tif", height=229, width=301)
    calls = []
    plain = torch.nn.functional.batch_norm
    monkeypatch.setattr(torch.nn.functional, "batch_norm",
                        lambda *a, **k: calls.append(1) or plain(*a, **k))
    ref = predict_full(net, torch.from_numpy(DATA(read_raster(image)))[None])
    opts = {"q": 2, "preview": False, "stac": False}  # two-pass: the image pooling
    fp, bns = net.footprint(), _bns(net)
    for fold, name in ((True, "fold.tif"), (False, "plain.tif")):
        calls.clear()
        predict_raster(net, image, tmp_path / name, PredictOptions(fold_bn=fold, **opts),
                       fp=fp, normalizer=DATA)
        if fold:  # the folding probe's one forward; the tiles run no BatchNorm at all
            assert len(calls) == bns
        else:  # every BatchNorm on each of the 4 tiles (and the image pooling's pass)
            assert len(calls) >= 4 * bns
        check_labels(read_raster(tmp_path / name)[0], ref)
    assert _bns(net) > 0  # the model given is unchanged
    with pytest.raises(OutputExistsError):  # the fingerprint records it: no silent reuse
        predict_raster(net, image, tmp_path / "fold.tif", PredictOptions(fold_bn=False, **opts),
                       fp=fp, normalizer=DATA)


def test_archive_queue_runs_the_folded_network(tmp_path, monkeypatch):
    from test_smp_predict import smp_run

    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction.archive import archive_scenes, predict_archive

    net = preset_model("unet_test_resnet")  # no whole-image statistic: the global queue
    trained = load_trained(smp_run(tmp_path / "run", model_node("unet_test_resnet"), net),
                           ckpt="last")
    (tmp_path / "in").mkdir()
    for i, (h, w) in enumerate(((229, 301), (197, 260))):
        make_image(tmp_path / "in" / f"s{i}.tif", height=h, width=w, seed=i)
    scenes = archive_scenes(str(tmp_path / "in" / "*.tif"), tmp_path / "out")
    calls = []
    plain = torch.nn.functional.batch_norm
    monkeypatch.setattr(torch.nn.functional, "batch_norm",
                        lambda *a, **k: calls.append(1) or plain(*a, **k))
    # layout given: layout=auto would time both layouts on a fresh cache (more BatchNorms,
    # counted here or not as another test measured first)
    records = predict_archive(trained, scenes, PredictOptions(
        fold_bn=True, q=2, preview=False, stac=False, progress=False, layout="contiguous"))
    assert [r.status for r in records] == ["done", "done"]
    assert len(calls) == _bns(net)  # the folding probe only: the tiles run none
    for s in scenes:
        ref = predict_full(net, torch.from_numpy(DATA(read_raster(s.image)))[None])
        check_labels(read_raster(s.output)[0], ref)
