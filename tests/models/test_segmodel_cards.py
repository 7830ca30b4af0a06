"""A .segmodel is checked, not trusted: its card against the network, its archive before reading.

Issue #39: a card edited (and its SHA256SUMS recomputed) must not make the tiles wrong
silently (a smaller halo, another padding, fewer classes); a zip member that declares
gigabytes must be refused before it is read; a card's architecture sizes are bounded
before anything is built.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.prediction import make_image, make_model, make_run

from seg_at_scale.errors import InputError
from seg_at_scale.models.segmodel import MAX_CARD_BYTES, read_card, read_model, write_model
from seg_at_scale.models.trained import load_run

PARTS = ("card.json", "weights.safetensors")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A same- and a valid-padding U-Net (3 levels, width 8), exported as .segmodel files."""
    tmp = tmp_path_factory.mktemp("cards")
    out = {}
    for padding in ("same", "valid"):
        run = make_run(tmp / f"run_{padding}", make_model(padding, levels=3, width=8))
        out[padding] = write_model(load_run(run, "last"), tmp / f"{padding}.segmodel")
    return out


def _parts(model: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(model) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _zip(path: Path, parts: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
    return path


def _sums(parts: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.sha256(parts[p]).hexdigest()}  {p}\n" for p in PARTS).encode()


def _set(card: dict[str, Any], key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = card
    for k in path:
        node = node[k]
    node[last] = value


def edited(model: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """``model`` with its card edited and SHA256SUMS recomputed (every checksum matches)."""
    parts = _parts(model)
    card = json.loads(parts["card.json"])
    edit(card)
    parts["card.json"] = (json.dumps(card, indent=2) + "\n").encode()
    parts["SHA256SUMS"] = _sums(parts)
    return _zip(out, parts)


def test_an_unedited_model_reads_and_records_its_weights_size(models):
    trained = read_model(models["same"])
    card = read_card(models["same"])
    assert trained.footprint.halo == trained.model.footprint().halo == 22
    assert card["weights"]["bytes"] == len(_parts(models["same"])["weights.safetensors"])


@pytest.mark.parametrize(("padding", "key", "value", "network"), [
    ("same", "footprint.halo", 2, "22"),                # tiles 11% off the whole image
    ("same", "footprint.padding", "valid", "'same'"),   # 81% off
    ("same", "footprint.align", 2, "4"),
    ("valid", "footprint.halo", 24, "20"),              # valid: the halo is the shrink
    ("same", "data.bands", 3, "4"),
    ("same", "data.num_classes", 3, "5"),               # would write class id 4
])
def test_a_card_contradicting_its_network_is_refused_at_load(models, tmp_path, padding, key,
                                                              value, network):
    def edit(card: dict[str, Any]) -> None:
        _set(card, key, value)
        if key == "data.num_classes":  # an edit consistent within the card
            card["data"]["class_names"] = card["data"]["class_names"][:value]
            card["data"]["colours"] = card["data"]["colours"][:value]

    bad = edited(models[padding], tmp_path / "edited.segmodel", edit)
    read_card(bad)  # checksums match: only the network tells
    with pytest.raises(InputError) as info:
        read_model(bad)
    msg = str(info.value)
    assert f"card.json has {key}={value!r} but the network has {network}" in msg, msg
    assert "\n" not in msg and "export the model again" in msg


def test_a_larger_halo_or_a_multiple_of_the_alignment_is_still_exact_and_accepted(models,
                                                                                   tmp_path):
    """A card's footprint is held to the rule ``infer(fp=)`` is held to (one rule): a
    multiple of the network's alignment tiles it exactly, as more context does."""
    from seg_at_scale.tiling import infer

    good = edited(models["same"], tmp_path / "wide.segmodel",
                  lambda card: _set(card, "footprint.halo", 30))
    assert read_model(good).footprint.halo == 30
    coarse = read_model(edited(models["same"], tmp_path / "coarse.segmodel",
                               lambda card: _set(card, "footprint.align", 8)))
    assert coarse.footprint.align == 8
    x = torch.randn(1, 4, 61, 53)
    assert torch.equal(infer(coarse.model, x, q=2, fp=coarse.footprint), infer(coarse.model, x))


def test_seg_predict_refuses_an_edited_halo_in_one_line(models, tmp_path):
    """The command's own path (checks, then the model loaded); an InputError exits 2."""
    from hydra import compose, initialize_config_dir

    import seg_at_scale.cli.predict as cli

    bad = edited(models["same"], tmp_path / "halo2.segmodel",
                 lambda card: _set(card, "footprint.halo", 2))
    image = make_image(tmp_path / "scene.tif", 64, 64)
    conf = Path(cli.__file__).resolve().parents[1] / "conf_predict"
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("predict", overrides=[f"model={bad}", f"image={image}",
                                            f"output={tmp_path / 'pred.tif'}", "progress=false"])
    with pytest.raises(InputError) as info:
        cli.run_prediction(cfg)
    assert "card.json has footprint.halo=2 but the network has 22" in str(info.value)
    assert "\n" not in str(info.value) and not (tmp_path / "pred.tif").exists()


@pytest.mark.parametrize(("key", "value", "bound"), [
    ("model.base_width", 200000, "1..4096"),  # was an allocator traceback
    ("model.levels", 40, "1..12"),
    ("model.num_classes", 1000, "1..254"),
    ("data.bands", 0, "1..1024"),
    ("footprint.halo", -1, "0..65536"),
])
def test_a_card_size_out_of_bounds_is_refused_before_building(models, tmp_path, key, value,
                                                              bound):
    bad = edited(models["same"], tmp_path / "big.segmodel", lambda card: _set(card, key, value))
    with pytest.raises(InputError, match=rf"card.json has {key}={value}, not a whole number "
                                         rf"in {bound}"):
        read_model(bad)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def edit(card: dict[str, Any]) -> None:
        *path, last = key.split(".")
        node = card
        for k in path:
            node = node[k]
        del node[last]
    return edit


@pytest.mark.parametrize(("edit", "key", "rule"), [
    (_drop("data.normalization"), "data.normalization", "not a mapping of keys"),
    (lambda c: _set(c, "data.normalization.mean", ["a"] * 4), "data.normalization.mean",
     "not a list of 1 or data.bands=4 numbers"),
    (lambda c: _set(c, "data.normalization.scale", 0), "data.normalization.scale",
     "not a number > 0"),
    (_drop("data.ignore_index"), "data.ignore_index", "not a whole number in 0..255"),
    (lambda c: _set(c, "data.input", {"dtype": "float99", "high": 1.0}), "data.input",
     "not {dtype: a numpy sample type, high: a number}"),
    (lambda c: _set(c, "data.input", "abc"), "data.input",
     "not {dtype: a numpy sample type, high: a number}"),
    (lambda c: _set(c, "data.colours", [[1000, 2, 3]] * 5), "data.colours",
     "not data.num_classes=5 colours of 3 or 4 values in 0..255"),
    (lambda c: _set(c, "data.colours", [[1, 2, 3]]), "data.colours",
     "not data.num_classes=5 colours of 3 or 4 values in 0..255"),
    (lambda c: _set(c, "data.nodata", "abc"), "data.nodata", "not a number, 'nan' or null"),
    (lambda c: _set(c, "data.class_names", [1, 2, 3, 4, 5]), "data.class_names",
     "not a list of data.num_classes=5 names"),
])
def test_every_data_key_the_predictor_reads_is_checked_at_load(models, tmp_path, edit, key,
                                                               rule):
    """Before: these edits (re-summed) failed in tracebacks (KeyError, TypeError,
    AssertionError), the colours after the COG and its preview were written."""
    bad = edited(models["same"], tmp_path / "edited.segmodel", edit)
    with pytest.raises(InputError, match=rf"card\.json has {re.escape(key)}=.*, "
                                         rf"{re.escape(rule)}; the card was edited or damaged"):
        read_model(bad)


def test_a_card_nested_too_deep_is_refused(models, tmp_path):
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(20):
        node["o"] = {}
        node = node["o"]
    bad = edited(models["same"], tmp_path / "deep.segmodel",
                 lambda card: _set(card, "model.options", deep))
    with pytest.raises(InputError, match=r"card.json has model.options(.o)+='\{...\}', nested "
                                         "more than 8 deep"):
        read_card(bad)


def test_a_network_larger_than_its_weights_is_refused_before_it_is_built(models, tmp_path):
    bad = edited(models["same"], tmp_path / "wide.segmodel",
                 lambda card: _set(card, "model.base_width", 256))  # in bounds, 100 MB
    with pytest.raises(InputError, match=r"the network card.json describes does not fit "
                                         r"weights.safetensors: \d+ shapes differ"):
        read_model(bad)


def _no_reading(monkeypatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a member was read")

    monkeypatch.setattr(zipfile.ZipFile, "open", refuse)


@pytest.mark.parametrize("member", ["weights.safetensors", "card.json"])
def test_a_compressed_member_declaring_more_is_refused_unread(models, tmp_path, monkeypatch,
                                                              member):
    """A zip bomb: 64 MiB of zeros deflated to 64 kB (the issue's was 4 GiB in 4.3 MB)."""
    parts = _parts(models["same"])
    bomb = tmp_path / "bomb.segmodel"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_STORED) as zf:
        for name, data in parts.items():
            if name != member:
                zf.writestr(name, data)
        info = zipfile.ZipInfo(member)
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w") as f:
            for _ in range(64):
                f.write(bytes(1 << 20))
    assert bomb.stat().st_size < 1 << 20
    _no_reading(monkeypatch)
    with pytest.raises(InputError, match=rf"{member} declares 67108864 bytes from \d+ in the "
                                         r"file \(deflated\)"):
        read_model(bomb)


def test_an_oversized_card_or_an_extra_member_is_refused_unread(models, tmp_path, monkeypatch):
    parts = _parts(models["same"])
    big = {**parts, "card.json": parts["card.json"] + b" " * MAX_CARD_BYTES}
    _zip(tmp_path / "big.segmodel", big)
    _zip(tmp_path / "extra.segmodel", {**parts, "notes.txt": b"hello"})
    folder = tmp_path / "big_folder"
    folder.mkdir()
    for name, data in big.items():
        (folder / name).write_bytes(data)
    _no_reading(monkeypatch)
    size = len(big["card.json"])
    with pytest.raises(InputError, match=rf"card.json declares {size} bytes, more than the "
                                         rf"{MAX_CARD_BYTES} it may hold"):
        read_model(tmp_path / "big.segmodel")
    with pytest.raises(InputError, match=r"holds 'notes.txt', which seg-export does not write"):
        read_model(tmp_path / "extra.segmodel")
    with pytest.raises(InputError, match=rf"card.json declares {size} bytes, more than"):
        read_card(folder)


def test_weights_of_another_size_than_the_card_records_are_refused_unread(models, tmp_path):
    size = len(_parts(models["same"])["weights.safetensors"])
    bad = edited(models["same"], tmp_path / "bytes.segmodel",
                 lambda card: _set(card, "weights.bytes", size + 1))
    with pytest.raises(InputError, match=rf"weights.safetensors declares {size} bytes but "
                                         rf"card.json records weights.bytes={size + 1}"):
        read_model(bad)
