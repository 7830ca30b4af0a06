"""Opening a model runs no code from its files: payloads refused, registry only, trust_run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import warm
from helpers.cli import run_train
from helpers.prediction import env, make_image, make_model, make_run, seg_predict
from omegaconf import OmegaConf

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models.checkpoint import UnsafeCheckpointError, load_checkpoint
from seg_at_scale.models.registry import build_model
from seg_at_scale.models.trained import load_run


class Payload:
    """What an attacker pickles: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run_with_payload(tmp: Path) -> tuple[Path, Path]:
    run = make_run(tmp / "run", make_model("same", levels=3, width=8))
    marker = tmp / "PWNED"
    ckpt = run / "checkpoints" / "last.ckpt"
    data = torch.load(ckpt, weights_only=True)
    torch.save({**data, "extra": Payload(marker)}, ckpt)
    return run, marker


def test_a_pickled_payload_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    run, marker = _run_with_payload(tmp_path)
    image = make_image(tmp_path / "scene.tif", 131, 97)
    out = seg_predict(run, image, tmp_path / "pred.tif", "ckpt=last", check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "posix.system" in lines[0] and "trust_run=true" in lines[0]
    assert str(run / "checkpoints" / "last.ckpt") in lines[0]
    assert not marker.exists() and not (tmp_path / "pred.tif").exists()


def test_trust_run_loads_what_the_user_trusts(tmp_path):
    run, marker = _run_with_payload(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert not marker.exists()
    load_run(run, "last", trust=True)  # the user said so: the pickle is unpickled
    assert marker.exists()


def test_a_config_naming_torch_load_is_refused_before_anything_is_built(tmp_path):
    run = make_run(tmp_path / "run", make_model("same", levels=3, width=8))
    marker = tmp_path / "PWNED"
    torch.save(Payload(marker), tmp_path / "weights.pt")
    cfg = OmegaConf.load(run / "run_config.yaml")
    cfg.model = {"_target_": "torch.load", "f": str(tmp_path / "weights.pt"),
                 "weights_only": False}
    OmegaConf.save(cfg, run / "run_config.yaml")
    image = make_image(tmp_path / "scene.tif", 131, 97)
    out = seg_predict(run, image, tmp_path / "pred.tif", "ckpt=last", check=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"run '{run}': model._target_='torch.load' is not a seg_at_scale model" in lines[0]
    assert not marker.exists()


@pytest.mark.parametrize(("node", "message"), [
    ({"_target_": "seg_at_scale.models.UNet", "levels": "3"},
     r"model.levels='3' is not a whole number"),
    ({"_target_": "seg_at_scale.models.UNet", "levls": 3},
     r"model.levls is not a model key \(did you mean model.levels\?\)"),
    ({"_target_": "seg_at_scale.models.GSCNN", "widths": [8, "x"]},
     r"model.widths=\[8, 'x'\] is not a list of"),
    ({"_target_": "seg_at_scale.models.UNet", "base_width": {"_target_": "os.system"}},
     r"model.base_width=\{'_target_': 'os.system'\} is not a whole number"),
    ({"_target_": "builtins.eval"}, r"is not a seg_at_scale model; the model families are "
                                    r"gscnn .*, unet .*, uresnet "),
])
def test_the_registry_checks_family_keys_and_types(node, message):
    with pytest.raises(ConfigError, match=message):
        build_model(node, where="run 'r'")


def test_every_family_is_built_from_its_run_config(tmp_path):
    for family in ("unet_tiny", "uresnet_tiny", "gscnn_tiny"):
        from hydra import compose, initialize_config_dir

        conf = str(Path(__file__).resolve().parents[2] / "seg_at_scale" / "conf")
        with initialize_config_dir(conf, version_base="1.3"):
            cfg = compose("train", overrides=[f"model={family}"])
        node = OmegaConf.to_container(cfg.model, resolve=True)
        net = build_model(node, where=family)
        assert type(net).__name__ == node["_target_"].rsplit(".", 1)[1]


def test_resuming_into_a_run_whose_checkpoint_carries_a_payload_is_refused(tmp_path):
    tiny = ["trainer=fast", "logger=csv", "model=unet_tiny", "data.synthetic.height=97",
            "data.synthetic.width=101", "data.synthetic.splits={train:1,val:1,test:1}",
            "tiling.tile_size=64", "predict_after_fit=false"]
    run_train(tmp_path, "run", *tiny)
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    last = run / "checkpoints" / "last.ckpt"
    data = torch.load(last, weights_only=True)
    torch.save({**data, "extra": Payload(marker)}, last)
    before = sorted(p.name for p in (run / ".hydra").iterdir())
    cmd = [sys.executable, "-m", "seg_at_scale.cli.train", f"hydra.run.dir={run}", *tiny,
           "trainer.max_epochs=2"]
    out = warm.run(cmd, capture_output=True, text=True, timeout=300,
                   env={**env(), "SEG_DATA_DIR": str(tmp_path / "data"),
                              "WANDB_MODE": "offline"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("seg-train: error: checkpoint")
    assert "posix.system" in out.stderr and not marker.exists()
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == before  # nothing written


def test_an_unreadable_checkpoint_names_the_file(tmp_path):
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match=r"empty.ckpt' is empty \(0 bytes\)"):
        load_checkpoint(empty)
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(3)}}, good)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(InputError, match=r"cut.ckpt' cannot be read .* truncated or not"):
        load_checkpoint(cut)
    text = tmp_path / "text.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(InputError, match=r"text.ckpt' cannot be read"):
        load_checkpoint(text)
    other = tmp_path / "other.ckpt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(InputError, match=r"other.ckpt' holds no state_dict"):
        load_checkpoint(other)


def test_a_file_pickle_dump_wrote_is_refused_as_one_torch_cannot_load_safely(tmp_path):
    """Before: "cannot be read (Weights only load failed. In PyTorch 2.6, we changed the
    default value of the weights_only argument in torch.load fr): it is truncated or not a
    torch checkpoint", after torch's warning about the pickle protocol."""
    import pickle
    import warnings

    marker = tmp_path / "PWNED"
    raw = tmp_path / "raw.ckpt"
    raw.write_bytes(pickle.dumps(Payload(marker), protocol=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning about the protocol is not shown
        with pytest.raises(UnsafeCheckpointError) as err:
            load_checkpoint(raw)
    assert str(err.value) == (
        f"checkpoint '{raw}' is not plain data torch can load without running code "
        "(Unsupported operand 149): a pickle not written by torch.save, or a damaged file; "
        "refused. Use another checkpoint, or pass trust_run=true only if you trust whoever "
        "made it (it may then run code)")
    assert not marker.exists()
