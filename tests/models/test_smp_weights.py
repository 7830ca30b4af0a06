"""Weights from files: layouts, reports, refusals, band maps, normalisation, hub names."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import timm
import torch
import torchvision
from omegaconf import OmegaConf
from safetensors.torch import save_file

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.models.trained import MEANING_KEY, weights_meaning
from seg_at_scale.models.weights import read_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEC = {"decoder_channels": [16, 16, 8, 8, 8]}


def unet(encoder: str = "resnet18", bands: int = 3, **kw) -> SMPModel:
    return SMPModel("Unet", encoder, in_channels=bands, num_classes=3, options=DEC, **kw)


def random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("encoder,prefix", [("resnet18", ""), ("tu-resnet18", "model.")])
def test_timm_layout_loads_into_smp_and_timm_encoders(tmp_path, encoder, prefix):
    state = random_state(timm.create_model("resnet18"), 1)  # with its classifier fc.*
    torch.save(state, tmp_path / "r18.pth")
    net = unet(encoder, encoder_weights=str(tmp_path / "r18.pth"))
    enc = net.net.encoder.state_dict()
    for key in ("conv1.weight", "layer4.1.conv2.weight", "layer2.0.bn1.running_var"):
        assert torch.equal(enc[prefix + key], state[key])
    assert "2 unexpected (e.g. fc.weight, fc.bias)" in net.weights_report[
        "model.encoder_weights"]


def test_torchvision_layout_as_safetensors(tmp_path):
    state = random_state(torchvision.models.resnet18(), 2)
    save_file(state, tmp_path / "tv.safetensors")
    net = unet("resnet18", encoder_weights=str(tmp_path / "tv.safetensors"))
    assert torch.equal(net.net.encoder.layer3[1].conv1.weight, state["layer3.1.conv1.weight"])


def test_timm_feature_names_are_matched(tmp_path):
    """timm's features_only flattens stem.0 into stem_0 (ConvNeXt): the plain layout fits."""
    state = random_state(timm.create_model("test_convnext"), 3)
    save_file(state, tmp_path / "cx.safetensors")
    net = unet("tu-test_convnext", encoder_weights=str(tmp_path / "cx.safetensors"))
    enc = net.net.encoder.state_dict()
    assert torch.equal(enc["model.stem_0.weight"], state["stem.0.weight"])
    assert torch.equal(enc["model.stages_1.blocks.0.conv_dw.weight"],
                       state["stages.1.blocks.0.conv_dw.weight"])


def test_torchgeo_layout_13_bands_with_band_map_and_statistics(tmp_path):
    """A torchgeo Sentinel-2 file: a timm resnet with 13 input channels, per-band
    statistics beside it; four bands (B4, B3, B2, B8) take channels 3, 2, 1, 7."""
    state = random_state(timm.create_model("resnet18", in_chans=13), 4)
    path = tmp_path / "resnet18_sentinel2_all_moco.pth"
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in state.items()}}, path)
    mean, std = [100.0 * b for b in range(13)], [10.0 + b for b in range(13)]
    (tmp_path / f"{path.name}.json").write_text(json.dumps(
        {"mean": mean, "std": std, "scale": 1.0}))
    net = unet("resnet18", bands=4, encoder_weights=str(path), band_map=[3, 2, 1, 7])
    conv = net.net.encoder.conv1.weight
    assert torch.equal(conv, state["conv1.weight"][:, [3, 2, 1, 7]])
    assert torch.equal(net.net.encoder.layer1[0].conv1.weight, state["layer1.0.conv1.weight"])
    norm = net.input_normalization()
    assert norm == {"mean": [300.0, 200.0, 100.0, 700.0], "std": [13.0, 12.0, 11.0, 17.0],
                    "scale": 1.0}


def test_lightning_checkpoint_encoder_and_whole_model(tmp_path):
    src = unet("tu-test_resnet", bands=4)
    random_state(src, 5)
    ckpt = {"state_dict": {f"model.{k}": v for k, v in src.state_dict().items()},
            "epoch": 3, "hyper_parameters": {"num_classes": 3}}
    torch.save(ckpt, tmp_path / "last.ckpt")
    enc = unet("tu-test_resnet", bands=4, encoder_weights=str(tmp_path / "last.ckpt"))
    for k, v in src.net.encoder.state_dict().items():
        assert torch.equal(enc.net.encoder.state_dict()[k], v)
    torch.save(src.net.state_dict(), tmp_path / "smp_model.pth")  # smp's own layout
    whole = unet("tu-test_resnet", bands=4, weights=str(tmp_path / "smp_model.pth")).eval()
    x = torch.randn(1, 4, 64, 96)
    assert torch.equal(whole(x), src.eval()(x))


def test_a_runs_checkpoint_gives_the_normalisation_its_network_was_trained_with(tmp_path):
    """A checkpoint a run wrote records the data normalisation it trained with; the model
    (whole, or its encoder through a band map) takes it, as from a safetensors header."""
    src = unet("tu-test_resnet", bands=4)
    random_state(src, 5)
    mean, std = [0.1, 0.25, 0.3, 0.45], [0.5, 0.625, 0.7, 0.8]
    cfg = OmegaConf.create({
        "model": {"_target_": "seg_at_scale.models.smp.SMPModel", "in_channels": 4},
        "data": {"bands": 4, "num_classes": 3, "scale": 1 / 255, "mean": mean, "std": std}})
    state = {f"model.{k}": v for k, v in src.state_dict().items()}
    torch.save({"state_dict": state, MEANING_KEY: weights_meaning(cfg)}, tmp_path / "run.ckpt")
    torch.save({"state_dict": state}, tmp_path / "other.ckpt")  # another tool's: no record
    whole = unet("tu-test_resnet", bands=4, weights=str(tmp_path / "run.ckpt"))
    assert whole.input_normalization() == {"mean": mean, "std": std, "scale": 1 / 255}
    enc = unet("tu-test_resnet", bands=5, encoder_weights=str(tmp_path / "run.ckpt"),
               band_map=[3, None, 0, 1, 2])
    assert enc.input_normalization() == {"mean": [0.45, None, 0.1, 0.25, 0.3],
                                         "std": [0.8, None, 0.5, 0.625, 0.7],
                                         "scale": 1 / 255}
    assert unet("tu-test_resnet", bands=4, weights=str(tmp_path / "other.ckpt")
                ).input_normalization() is None


def test_band_map_onto_rgb_weights_gives_the_rgb_model(tmp_path):
    """Six bands, three of them mapped onto the RGB weights, the others at zero: exactly
    the three-band pretrained model on those bands, whatever the others hold."""
    rgb = unet("tu-test_resnet", bands=3)
    random_state(rgb, 6)
    save_file(rgb.net.state_dict(), tmp_path / "rgb.safetensors")
    six = unet("tu-test_resnet", bands=6, weights=str(tmp_path / "rgb.safetensors"),
               band_map=[None, 0, None, 1, 2, None]).eval()
    x3 = torch.randn(1, 3, 96, 64)
    x6 = torch.randn(1, 6, 96, 64) * 100
    x6[:, [1, 3, 4]] = x3
    ref = rgb.eval()(x3)
    out = six(x6)
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert torch.equal(out.argmax(1), ref.argmax(1))


def test_default_band_rule_extra_bands_start_at_zero(tmp_path):
    state = random_state(timm.create_model("resnet18"), 7)
    save_file(state, tmp_path / "r18.safetensors", metadata={
        "mean": json.dumps([0.485, 0.456, 0.406]), "std": json.dumps([0.229, 0.224, 0.225])})
    net = unet("resnet18", bands=5, encoder_weights=str(tmp_path / "r18.safetensors"))
    conv = net.net.encoder.conv1.weight
    assert torch.equal(conv[:, :3], state["conv1.weight"])
    assert not conv[:, 3:].any()
    assert net.input_normalization() == {"mean": [0.485, 0.456, 0.406, None, None],
                                         "std": [0.229, 0.224, 0.225, None, None],
                                         "scale": None}
    saved = {k: v for k, v in net.state_dict().items() if k.startswith("input_")}
    assert set(saved) == {"input_mean", "input_std", "input_scale"}  # in every checkpoint


def test_a_file_of_another_encoder_is_refused_naming_keys(tmp_path):
    torch.save(random_state(timm.create_model("resnet18"), 8), tmp_path / "r18.pth")
    with pytest.raises(InputError, match=r"does not fit encoder resnet34: \d+ of \d+ tensors "
                       r"missing \(first layer1\.2\.conv1\.weight \[64, 64, 3, 3\]\); the "
                       r"file's first keys are conv1\.weight \[64, 3, 7, 7\]"):
        SMPModel("Unet", "resnet34", in_channels=3, num_classes=2,
                 encoder_weights=str(tmp_path / "r18.pth"))
    torch.save(random_state(timm.create_model("test_resnet"), 8), tmp_path / "test.pth")
    with pytest.raises(InputError, match=r"does not fit encoder resnet18: .* is \[.*\] in the "
                       r"file but \[.*\] in the model"):
        unet("resnet18", encoder_weights=str(tmp_path / "test.pth"))


def test_a_whole_network_of_other_classes_is_refused_naming_both_counts_and_both_fixes(
        tmp_path):
    """Before: named as weights that do not fit encoder resnet18 ("give weights of
    resnet18"), though its encoder fits; the file's encoder is then used as it says."""
    five = SMPModel("Unet", "resnet18", in_channels=3, num_classes=5, options=DEC)
    torch.save(random_state(five.net, 4), tmp_path / "unet5.pth")
    with pytest.raises(InputError) as err:
        unet("resnet18", weights=str(tmp_path / "unet5.pth"))
    assert str(err.value) == (
        f"model.weights='{tmp_path / 'unet5.pth'}' holds a network of 5 classes, and the "
        "model has 3 (segmentation_head.0.weight is [5, 8, 3, 3] in the file, [3, 8, 3, 3] "
        "in the model): set data.num_classes=5 to predict the file's classes, or give the "
        "file as model.encoder_weights to train a new head of 3 classes on its encoder")
    three = unet("resnet18", encoder_weights=str(tmp_path / "unet5.pth"))
    for k, v in three.net.encoder.state_dict().items():
        torch.testing.assert_close(v, five.net.encoder.state_dict()[k], rtol=0, atol=0)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_weights_of_a_larger_network_are_refused_naming_the_unused_tensors(tmp_path, suffix):
    """Every key of resnet18 is in resnet34 at its shape: resnet34's file loaded into
    tu-resnet18, its 96 extra tensors named only in an INFO line. Now refused; the
    pretraining task's head (fc.*) alone is still ignored."""
    state = random_state(timm.create_model("resnet34"), 11)
    path = tmp_path / f"resnet34{suffix}"
    if suffix == ".pth":
        torch.save(state, path)
    else:
        save_file(state, path)
    with pytest.raises(InputError) as err:
        unet("tu-resnet18", encoder_weights=str(path))
    assert str(err.value) == (
        f"model.encoder_weights='{path}' does not fit encoder tu-resnet18: 96 of its tensors "
        "(besides its classifier head fc.*) have no place in it (e.g. layer1.2.bn1.weight, "
        "layer2.2.bn1.weight, layer2.3.bn1.weight): the weights of another or a larger "
        "network; give weights of tu-resnet18")


@pytest.mark.parametrize("encoder,model,head", [
    ("tu-test_efficientnet", "test_efficientnet", "8 unexpected"),  # conv_head, bn2, classifier
    ("tu-test_convnext", "test_convnext", "4 unexpected"),  # head.norm, head.fc
])
def test_the_pretraining_head_is_the_only_tolerated_extra(tmp_path, encoder, model, head):
    save_file(random_state(timm.create_model(model), 12), tmp_path / "w.safetensors")
    net = unet(encoder, encoder_weights=str(tmp_path / "w.safetensors"))
    assert f"0 missing, {head}" in net.weights_report["model.encoder_weights"]


def test_non_finite_weights_are_refused_naming_the_file_and_a_key(tmp_path):
    """An all-NaN file loaded and trained to val/loss = nan."""
    nan = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
           for k, v in timm.create_model("resnet18").state_dict().items()}
    save_file(nan, tmp_path / "nan.safetensors")
    with pytest.raises(InputError) as err:
        unet("tu-resnet18", encoder_weights=str(tmp_path / "nan.safetensors"))
    assert str(err.value) == (
        f"model.encoder_weights='{tmp_path / 'nan.safetensors'}' holds NaN or infinite values "
        "in 100 of the 100 float tensors it loads (first conv1.weight: 9408 of 9408 values); "
        "training from them gives a loss of nan; give an intact file (save or download it "
        "again)")
    state = random_state(timm.create_model("resnet18"), 13)
    state["layer3.1.bn2.running_var"][5] = float("inf")
    torch.save(state, tmp_path / "inf.pth")
    with pytest.raises(InputError, match=r"inf\.pth' holds NaN or infinite values in 1 of the "
                       r"100 float tensors it loads \(first layer3\.1\.bn2\.running_var: 1 of "
                       r"256 values\)"):
        unet("resnet18", encoder_weights=str(tmp_path / "inf.pth"))


def test_files_that_would_run_code_or_do_not_exist_are_refused(tmp_path):
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "cfg": torch.nn.ReLU()},
               tmp_path / "pickled.ckpt")
    with pytest.raises(InputError, match=r"holds a Python object \(torch\.nn\.modules\."
                       r"activation\.ReLU\) that loading would run; refused"):
        read_weights(tmp_path / "pickled.ckpt", key="model.encoder_weights")
    with pytest.raises(InputError, match=r"model.weights='.*nope.pth' does not exist"):
        unet(weights=str(tmp_path / "nope.pth"))
    with pytest.raises(InputError, match=r"model.weights='s3://b/w.pth' is a URL \(s3:\): .*"
                                         "copy it to a local or mounted folder first"):
        unet(weights="s3://b/w.pth")
    with pytest.raises(InputError, match="model.encoder_weights='/vsicurl/https://x.org/e.pth' "
                                         "is a GDAL virtual path"):
        read_weights("/vsicurl/https://x.org/e.pth", key="model.encoder_weights")


def test_a_folder_a_plain_pickle_and_a_misspelt_name_are_told_for_what_they_are(
        tmp_path, monkeypatch):
    """Before: a folder "does not exist"; a pickle.dump state dict was "neither a zip nor a
    pickle"; a misspelt name or file (``imagenett``, ``w.safetensor``, ``weights/resnet34``)
    was a hub name to download with `hf download <repo> ...`, a command that cannot work."""
    import pickle

    from seg_at_scale.models.weights import check_hub_name

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    with pytest.raises(InputError, match=r"model.encoder_weights='weights' is a folder; give "
                                         r"the path of a weights file"):
        read_weights("weights", key="model.encoder_weights")
    with (tmp_path / "plain.pth").open("wb") as f:
        pickle.dump(dict(timm.create_model("test_resnet").state_dict()), f)
    with pytest.raises(InputError, match=r"plain\.pth' is a pickle not written by torch\.save "
                                         r"\(pickle\.dump\), which torch cannot load as plain "
                                         r"data; save the state dict with torch\.save"):
        read_weights(tmp_path / "plain.pth", key="model.encoder_weights")
    for spec in ("imagenett", "w.safetensor"):
        with pytest.raises(ConfigError) as err:
            check_hub_name(spec, "resnet34", key="model.encoder_weights")
        assert str(err.value) == (
            f"model.encoder_weights={spec!r} is no file here, and encoder 'resnet34' has no "
            "weights of that name (its names: imagenet); give the path of a weights file "
            "(.safetensors, .pth, .pt, .ckpt, .bin), one of its names, or a hub repository "
            "(hf-hub:org/name)")
    with pytest.raises(ConfigError, match=r"encoder 'tu-resnet18' has no weights of that name "
                                          r"\(its names: imagenet, a1_in1k, "):
        check_hub_name("imagenett", "tu-resnet18", key="model.encoder_weights")
    with pytest.raises(InputError, match=r"model.weights='weights/resnet34' does not exist; give "
                                         r"the path of a weights file \(.*\) \(a hub "
                                         r"repository is written hf-hub:weights/resnet34\)"):
        unet(weights="weights/resnet34")


def test_hub_name_refused_offline_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        unet("resnet18", encoder_weights="imagenet")
    msg = str(err.value)
    assert "\n" not in msg
    assert "model.encoder_weights='imagenet' is a hub name, but this machine is offline" in msg
    assert "smp-hub/resnet18.imagenet" in msg and "model.encoder_weights=/path/to/" in msg


def test_offline_is_decided_once_within_the_deadline(monkeypatch):
    """A name server that never answers held the hub probe (socket.create_connection
    bounds the connection, not the lookup) for as long as it hung, once per weights key."""
    from seg_at_scale.models import weights

    lookups, release = [], threading.Event()

    def never_answers(*args, **kwargs):
        lookups.append(args[0])
        release.wait(5)
        raise socket.gaierror("timed out")

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.invalid")
    monkeypatch.setattr(weights, "_HUB_PROBE", {}, raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    try:
        assert weights.is_offline(timeout=0.2) and weights.is_offline(timeout=0.2)
    finally:
        release.set()
    assert lookups == ["hub.example.invalid"]  # asked once, abandoned at the deadline


def test_a_cached_hub_name_needs_no_network(tmp_path, monkeypatch):
    """Hub weights already in the local Hugging Face cache (its layout: snapshots named by
    refs/main) load offline, where before any hub name was refused."""
    state = random_state(timm.create_model("resnet18"), 14)
    snap = tmp_path / "hub" / "models--smp-hub--resnet18.imagenet" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    save_file(state, snap / "model.safetensors")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    net = unet("resnet18", encoder_weights="imagenet")
    assert torch.equal(net.net.encoder.conv1.weight, state["conv1.weight"])


def test_band_map_errors_name_the_key(tmp_path):
    save_file(random_state(timm.create_model("resnet18"), 9), tmp_path / "r.safetensors")
    with pytest.raises(ConfigError, match=r"model.band_map=\[0, 1\] has 2 entries for 4"):
        unet(bands=4, encoder_weights=str(tmp_path / "r.safetensors"), band_map=[0, 1])
    with pytest.raises(ConfigError, match=r"channel 5 is not one of the weights' 3 input"):
        unet(bands=2, encoder_weights=str(tmp_path / "r.safetensors"), band_map=[0, 5])
    with pytest.raises(ConfigError, match="no weights are given"):
        unet(bands=2, band_map=[0, 1])


def test_a_checkpoint_rebuild_needs_no_weights_file(tmp_path):
    """Prediction rebuilds the model from its run config and loads the checkpoint: with the
    weights keys nulled the original file may be gone; the normalisation comes back."""
    from seg_at_scale.models.registry import build_model, without_weight_files

    state = random_state(timm.create_model("resnet18"), 10)
    save_file(state, tmp_path / "r18.safetensors", metadata={
        "mean": json.dumps([0.1, 0.2, 0.3]), "std": json.dumps([1.0, 2.0, 3.0])})
    node = {"_target_": "seg_at_scale.models.SMPModel", "arch": "Unet", "encoder": "resnet18",
            "in_channels": 4, "num_classes": 3, "options": DEC,
            "encoder_weights": str(tmp_path / "r18.safetensors"), "band_map": [0, 1, 2, None]}
    trained = build_model(node, where="t").eval()
    ckpt = {k: v.clone() for k, v in trained.state_dict().items()}
    (tmp_path / "r18.safetensors").unlink()
    bare = without_weight_files(node)
    assert (bare["encoder_weights"], bare["band_map"], bare["arch"]) == (None, None, "Unet")
    again = build_model(bare, where="t")
    again.load_state_dict(ckpt)
    x = torch.randn(1, 4, 64, 64)
    assert torch.equal(again.eval()(x), trained(x))
    assert again.input_normalization()["mean"] == [0.1, 0.2, 0.3, None]


def test_a_whole_model_trained_with_size_dependent_upsampling_is_told_how_it_differs(
        tmp_path, caplog):
    """Before: ``model.weights=<an FPN trained elsewhere>`` ran with align_corners=False
    upsampling (the exact kind) and predicted other labels than the file's model (FPN:
    about 1 in 8 pixels), without a word. The warning's fix gives the file's own logits."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    ref = smp.create_model("FPN", encoder_name="tu-test_resnet", encoder_weights=None,
                           in_channels=4, classes=3).eval()
    path = tmp_path / "fpn.pth"
    torch.save(ref.state_dict(), path)
    x = torch.randn(1, 4, 64, 96)
    with caplog.at_level("WARNING", logger="seg_at_scale.models.smp"):
        exact = SMPModel("FPN", "tu-test_resnet", 4, 3, weights=str(path)).eval()
    (record,) = [r.getMessage() for r in caplog.records]
    assert record == (
        f"model.weights '{path}': smp's FPN upsamples with align_corners=True (7 places), "
        "which depends on the image size and no tiling reproduces; this network upsamples "
        "with align_corners=False, so it predicts other logits than the model the file holds "
        "(fine-tuning adapts them). To predict as that model: model.align_corners=true "
        "tiling.exact=false (approximate tiles)")
    with torch.no_grad():
        assert not torch.allclose(exact(x), ref(x), atol=1e-4)
    caplog.clear()
    with caplog.at_level("WARNING", logger="seg_at_scale.models.smp"):
        same = SMPModel("FPN", "tu-test_resnet", 4, 3, weights=str(path),
                        align_corners=True).eval()
        torch.save(unet("tu-test_resnet", bands=4).net.state_dict(), tmp_path / "unet.pth")
        unet("tu-test_resnet", bands=4, weights=str(tmp_path / "unet.pth"))  # no bilinear
    assert caplog.records == []
    with torch.no_grad():
        assert torch.equal(same(x), ref(x))
