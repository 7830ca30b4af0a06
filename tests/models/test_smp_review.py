"""Review fixes of the smp family: ambiguous files, approximate tiling, normalisation, files."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from helpers.prediction import make_image
from helpers.smp import lively
from omegaconf import OmegaConf

from seg_at_scale.cli.pretrained import run_footprint
from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.io import read_raster
from seg_at_scale.models import smp as smp_module
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.models.weights import normalization_of, read_weights
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.raster import predict_raster
from seg_at_scale.tiling import predict_full

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEC = {"decoder_channels": [16, 16, 8, 8, 8]}


def unet(encoder: str = "tu-test_resnet", bands: int = 3, **kw) -> SMPModel:
    return SMPModel("Unet", encoder, in_channels=bands, num_classes=3, options=DEC, **kw)


def timm_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = timm.create_model("test_resnet")
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    return {k: v.clone() for k, v in net.state_dict().items()}


# ----- 1. two networks in one file ----------------------------------------------------------

def test_moco_file_loads_the_query_encoder(tmp_path):
    """MoCo saves the query and the momentum encoder, same names, same length: the query's
    tensors load, whatever the order of the prefixes, and the report names the prefix."""
    q, k = timm_state(1), timm_state(2)
    state = {**{f"module.encoder_k.{n}": v for n, v in k.items()},
             **{f"module.encoder_q.{n}": v for n, v in q.items()}}
    torch.save({"state_dict": state}, tmp_path / "moco.pth")
    net = unet(encoder_weights=str(tmp_path / "moco.pth"))
    enc = net.net.encoder.state_dict()
    for name in ("conv1.0.weight", "layer4.0.conv1.weight", "layer2.0.bn1.running_mean"):
        assert torch.equal(enc[f"model.{name}"], q[name])
    assert "file prefix 'module.encoder_q.'" in net.weights_report["model.encoder_weights"]


def test_two_backbones_in_one_file_are_refused_naming_both(tmp_path):
    a, b = timm_state(3), timm_state(4)
    torch.save({**{f"a.{n}": v for n, v in a.items()}, **{f"b.{n}": v for n, v in b.items()}},
               tmp_path / "two.pth")
    with pytest.raises(InputError) as err:
        unet(encoder_weights=str(tmp_path / "two.pth"))
    msg = str(err.value)
    assert "\n" not in msg and "two.pth' holds several networks" in msg
    assert "['a.', 'b.']" in msg and "save the one you mean alone" in msg


# ----- 2. tiling.exact=false runs what exact tiling refuses ---------------------------------

def predict_file(net: SMPModel, fp, tmp_path) -> tuple[np.ndarray, torch.Tensor]:
    """``seg-predict``'s path for ``tiling.exact=false`` (small tiles: several overlap), and
    the whole-image forward's labels."""
    image = make_image(tmp_path / "scene.tif", height=150, width=130)
    out = tmp_path / "labels.tif"
    predict_raster(net, image, out, PredictOptions(tile_size=2 * fp.context + 64, fast=False,
                                                   progress=False), fp=fp, exact=False)
    x = torch.from_numpy(read_raster(image).astype(np.float32) / 255)[None]
    return read_raster(out)[0], predict_full(net, x, fp).argmax(1)[0]


@pytest.mark.parametrize("arch,encoder,options,corners", [
    ("Unet", "efficientnet-b0", DEC, False),  # SE inside smp's MBConv blocks
    ("FPN", "tu-test_resnet", {"decoder_pyramid_channels": 32,
                               "decoder_segmentation_channels": 32}, True),
])
def test_exact_false_gives_a_footprint_and_predicts(tmp_path, arch, encoder, options, corners):
    net = lively(SMPModel(arch, encoder, in_channels=4, num_classes=3, options=options,
                          align_corners=corners))
    with pytest.raises(ConfigError):
        net.footprint()
    fp = run_footprint(net, OmegaConf.create({"exact": False, "halo": "auto"}))
    assert fp.align == 32 and 32 <= fp.halo < 2048
    labels, ref = predict_file(net, fp, tmp_path)
    assert labels.shape == (150, 130)
    agree = float((torch.from_numpy(labels.astype(np.int64)) == ref).float().mean())
    assert agree > 0.5  # approximate, but the same network


def test_approximate_cache_tells_align_corners_apart():
    opts = {"decoder_pyramid_channels": 32, "decoder_segmentation_channels": 32}
    key = ("approximate", "FPN", "tu-test_resnet", 4, repr(sorted(opts.items())))
    SMPModel("FPN", "tu-test_resnet", in_channels=4, num_classes=3, options=opts,
             align_corners=True).approximate_footprint()
    assert (*key, True) in smp_module._HALOS


def test_align_corners_refusal_names_the_fix():
    net = SMPModel("FPN", "tu-test_resnet", in_channels=3, num_classes=2, align_corners=True)
    with pytest.raises(ConfigError) as err:
        net.footprint()
    msg = str(err.value)
    assert "\n" not in msg and "align_corners=True" in msg
    assert "set model.align_corners=false" in msg and "model.encoder=resnet34" not in msg


def test_a_probe_failing_under_exact_false_falls_back_and_says_why(monkeypatch, caplog):
    def fails(*args, **kwargs):
        raise RuntimeError("stack expects each tensor to be equal size\nmore")

    monkeypatch.setattr(smp_module, "empirical_halo", fails)
    monkeypatch.setattr(smp_module, "_HALOS", {})  # not a halo another test probed
    monkeypatch.setattr(smp_module, "_FALLBACK", {})
    net = SMPModel("Unet", "tu-test_efficientnet", in_channels=4, num_classes=3,
                   options=DEC)
    with caplog.at_level("WARNING", logger="seg_at_scale.models.smp"):
        fp = net.approximate_footprint()
    assert (fp.halo, fp.align) == (64, 32)
    assert [r.getMessage() for r in caplog.records] == [
        "tiling.exact=false with model.arch=Unet model.encoder=tu-test_efficientnet: the halo "
        "probe fails on the network with its non-local modules skipped (stack expects each "
        "tensor to be equal size), so its approximate halo is 64 px (two alignment steps, or "
        "more where the network takes no smaller tile); tiling.halo=<pixels> gives tiles a "
        "wider overlap"]


# ----- 3, 4. the weights' normalisation given to the data: all of it or none ----------------

class Recorded(torch.nn.Module):
    def __init__(self, norm: dict | None) -> None:
        super().__init__()
        self.norm = norm

    def input_normalization(self) -> dict | None:
        return self.norm


class Run:
    """The part of RunFolder use_weights_normalization uses."""

    resuming = False

    def __init__(self) -> None:
        self.filled: dict = {}

    def fill(self, cfg, key, compute):
        from omegaconf import open_dict

        with open_dict(cfg):
            OmegaConf.update(cfg, key, compute(), force_add=True)


def normalize(norm: dict | None, policy: str = "weights", **data) -> OmegaConf:
    from seg_at_scale.cli.pretrained import use_weights_normalization

    cfg = OmegaConf.create({"data": {"bands": 2, "scale": "auto", "mean": "auto",
                                     "std": "auto", **data},
                            "finetune": {"normalization": policy}})
    use_weights_normalization(cfg, Recorded(norm), Run(), {})
    return cfg.data


def test_data_scale_auto_takes_the_weights_scale():
    norm = {"mean": [0.1, 0.2], "std": [1.0, 2.0], "scale": 0.5}
    data = normalize(norm)
    assert (data.scale, list(data.mean), list(data.std)) == (0.5, [0.1, 0.2], [1.0, 2.0])
    kept = normalize(norm, "data")  # nothing to compare with: kept, no error
    assert (kept.scale, kept.mean, kept.std) == ("auto", "auto", "auto")


def test_uncovered_bands_apply_all_or_nothing(caplog):
    norm = {"mean": [0.1, None], "std": [1.0, None], "scale": None}
    with caplog.at_level("WARNING"):
        data = normalize(norm, std=[0.2, 0.3])  # mean auto: cannot be half filled
    assert data.mean == "auto" and list(data.std) == [0.2, 0.3]
    assert "none of the weights' normalisation is applied" in caplog.text
    assert "bands [1] have no pretrained statistics" in caplog.text
    data = normalize(norm, mean=[5.0, 6.0], std=[0.2, 0.3])  # given: the covered bands
    assert (list(data.mean), list(data.std)) == ([0.1, 6.0], [1.0, 0.3])
    scaled = {**norm, "scale": 0.5}  # the data's statistics for another scale: none
    data = normalize(scaled, mean=[5.0, 6.0], std=[0.2, 0.3], scale=1.0)
    assert (list(data.mean), list(data.std), data.scale) == ([5.0, 6.0], [0.2, 0.3], 1.0)


def test_the_log_names_the_values_the_weights_replace(caplog):
    """Before: "data.mean from the weights: [0.1, 0.2] (was [0.1, 0.2])": the old value was
    read after it had been replaced."""
    norm = {"mean": [0.1, 0.2], "std": [1.0, 2.0], "scale": None}
    with caplog.at_level("INFO", logger="seg_at_scale.cli.pretrained"):
        normalize(norm, scale=1.0, mean=[0.5, 0.5], std=[0.25, 0.25])
    assert "data.mean from the weights: [0.1, 0.2] (was [0.5, 0.5])" in caplog.text
    assert "data.std from the weights: [1.0, 2.0] (was [0.25, 0.25])" in caplog.text


def test_the_policy_is_checked_also_without_recorded_normalisation():
    with pytest.raises(ConfigError, match="finetune.normalization='wieghts': use 'weights'"):
        normalize(None, "wieghts")


# ----- 5. files that are not weights ---------------------------------------------------------

class Runs:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_truncated_file_and_a_missing_path_are_told_what_they_are(tmp_path):
    """Before: torch's text cut at 120 characters ("... internal miniz error. If yo"), and
    a missing ``w/nope.pth`` was offered as the hub repository ``hf-hub:w/nope.pth``."""
    torch.save({"w": torch.zeros(1000)}, tmp_path / "whole.pth")
    body = (tmp_path / "whole.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(body[: len(body) // 2])
    with pytest.raises(InputError) as err:
        read_weights(tmp_path / "cut.pth", key="model.encoder_weights")
    said = str(err.value)
    assert said.startswith(f"model.encoder_weights='{tmp_path / 'cut.pth'}' is not a readable "
                           "PyTorch file (a torch.save zip that is truncated or damaged: ")
    assert "If yo" not in said and said.endswith(
        "); give a state dict saved with torch.save or a .safetensors file")
    (tmp_path / "w").mkdir()
    for missing in (tmp_path / "w" / "nope.pth", Path("w/nope.pth")):
        with pytest.raises(InputError) as err:
            read_weights(missing, key="model.encoder_weights")
        assert str(err.value) == (
            f"model.encoder_weights='{missing}' does not exist; give the path of a weights "
            "file (.safetensors, .pth, .pt, .ckpt, .bin)")


def test_text_html_and_pickled_objects_are_refused_in_one_line(tmp_path):
    (tmp_path / "notes.pth").write_text("hello, this is not a torch file\n")
    (tmp_path / "page.pth").write_text("<!DOCTYPE html><html><body>404</body></html>")
    for name, begins in (("notes.pth", "b'hello, this is n'"), ("page.pth", "b'<!DOCTYPE html><'")):
        with pytest.raises(InputError) as err:
            read_weights(tmp_path / name, key="model.encoder_weights")
        assert str(err.value) == (
            f"model.encoder_weights='{tmp_path / name}' is not a readable PyTorch file "
            f"(neither a zip nor a pickle: it begins {begins}); give a state dict saved "
            "with torch.save or a .safetensors file")
    marker = tmp_path / "ran"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "hook": Runs(marker)}, tmp_path / "x.pth")
    with pytest.raises(InputError) as err:
        read_weights(tmp_path / "x.pth", key="model.encoder_weights")
    msg = str(err.value)
    assert "\n" not in msg and "\x1b" not in msg and not marker.exists()
    assert f"holds a Python object ({os.system.__module__}.system) that loading would run; " \
           "refused. Save its state_dict() alone" in msg


# ----- 6. recorded normalisation that is not numbers -----------------------------------------

def test_null_scale_means_the_data_scale(tmp_path):
    torch.save(timm_state(5), tmp_path / "r.pth")
    (tmp_path / "r.pth.json").write_text(json.dumps({"mean": [0.4, 0.5, 0.6],
                                                     "std": [0.1, 0.2, 0.3], "scale": None}))
    net = unet(encoder_weights=str(tmp_path / "r.pth"))
    assert net.input_normalization() == {"mean": [0.4, 0.5, 0.6], "std": [0.1, 0.2, 0.3],
                                         "scale": None}


def test_normalisation_that_is_not_numbers_names_file_and_key(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(InputError) as err:
        normalization_of(path, {"mean": "imagenet", "std": "[1, 2, 3]"})
    assert str(err.value).startswith(f"'{path}' (its safetensors header): mean='imagenet' is "
                                     "not JSON; write the statistics as JSON")
    (tmp_path / "s.pth.json").write_text(json.dumps({"mean": 0.5, "std": [0.2]}))
    with pytest.raises(InputError, match=r"s\.pth\.json': mean=0\.5 is not a list of numbers"):
        normalization_of(tmp_path / "s.pth", {})
    (tmp_path / "s.pth.json").write_text("{'mean': [0.5]}")
    with pytest.raises(InputError, match=r"s\.pth\.json': .* is not JSON"):
        normalization_of(tmp_path / "s.pth", {})


# ----- 7. a hub download that fails ---------------------------------------------------------

def test_a_failed_download_names_the_spec_and_the_offline_fix(monkeypatch):
    import huggingface_hub

    from seg_at_scale.models import weights

    def refuse(*args, **kwargs):
        raise OSError("Connection reset by peer\nretrying")

    monkeypatch.setattr(weights, "is_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(ConfigError) as err:
        weights.resolve_weights("hf-hub:org/net", "tu-test_resnet", key="model.encoder_weights")
    assert str(err.value) == (
        "model.encoder_weights='hf-hub:org/net': downloading model.safetensors of org/net "
        "from the Hugging Face hub failed (Connection reset by peer); download it where "
        "there is internet (`hf download org/net model.safetensors config.json`) and pass "
        "the file: model.encoder_weights=/path/to/model.safetensors")


# ----- 9. Gated-SCNN's timm backbone is its pretrained encoder ------------------------------

def test_gscnn_timm_backbone_is_fine_tuned_as_an_encoder():
    from seg_at_scale.models import GSCNN
    from seg_at_scale.tasks.finetune import (
        check_finetune,
        encoder_parameters,
        freeze_batch_norm,
        optimizer_groups,
    )

    net = GSCNN.from_preset("tiny", in_channels=3, num_classes=3, backbone="test_resnet")
    check_finetune(net, "encoder", 1, 0.1)  # refused before: "GSCNN has none"
    assert {id(p) for p in encoder_parameters(net)} == {id(p) for p in net.regular.parameters()}
    frozen = freeze_batch_norm(net.train(), "encoder")
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert frozen == sum(1 for m in net.regular.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert [m.training for m in bns] == [not any(m is r for r in net.regular.modules())
                                         for m in bns]
    make = functools.partial(torch.optim.SGD, lr=1.0)
    groups = optimizer_groups(net, net.parameters(), make, 0.1)
    assert groups[1]["lr"] == 0.1 and len(groups[1]["params"]) == len(list(
        net.regular.parameters()))
    with pytest.raises(ConfigError) as err:
        check_finetune(GSCNN.from_preset("tiny", in_channels=3, num_classes=3), "all", 1, 1.0)
    # before: freeze_bn='all', which any model honours, was named among the keys at fault
    assert str(err.value) == (
        "finetune.freeze_encoder_epochs=1 need a model with a pretrained encoder (GSCNN has "
        "none): give finetune.freeze_encoder_epochs=0 (finetune.freeze_bn=all freezes "
        "BatchNorm in any model), or use model=unet_resnet34 (or any smp preset) or Gated-SCNN "
        "with model.backbone=<timm network>")
