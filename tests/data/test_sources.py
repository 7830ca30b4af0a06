"""Every dataset source follows the one folder rule (data/manifest.py): a folder made with
other parameters is refused the same way, naming what differs, and nothing in it changes;
``overwrite`` rebuilds it; the same parameters reuse it without writing."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.sources import tiny_event, write_cityscapes, write_larcv, write_taco

from seg_at_scale.cli.data_setup import make_synthetic, source_of
from seg_at_scale.data.sources.base import Source, scene_seed
from seg_at_scale.errors import ConfigError, InputError, OutputExistsError


def _inputs(tmp: Path, name: str) -> dict[str, object]:
    """The real-format input each converter needs, written once; its options."""
    if name == "cosmic_h5":
        path = tmp / "events.h5"
        if not path.exists():
            write_larcv(path, [tiny_event(s, (3, 8, 12)) for s in range(3)])
        return {"path": path}
    if name == "cityscapes":
        if not (tmp / "cs").exists():
            write_cityscapes(tmp / "cs", "train", "aachen", 2)
        return {"source": tmp / "cs"}
    if name == "taco":
        if not (tmp / "taco").exists():
            write_taco(tmp / "taco")
        return {"source": tmp / "taco"}
    return {}


# source -> (its generator, its node with the value v, the key that differs with v)
SOURCES = {
    "synthetic": ("synthetic.SyntheticScenes", lambda v: {"height": 40, "width": 52, "seed": v},
                  "seed"),
    "streets": ("streets.Streets", lambda v: {"height": 40, "width": 56, "seed": v}, "seed"),
    "cosmic": ("cosmic.CosmicEvents", lambda v: {"height": 24, "width": 40, "seed": v}, "seed"),
    "cosmic_h5": ("cosmic.CosmicH5", lambda v: {"splits": {"train": v + 1}}, "splits"),
    "cityscapes": ("cityscapes.Cityscapes", lambda v: {"splits": {"train": v + 1}}, "splits"),
    "taco": ("taco.Taco", lambda v: {"seed": v}, "seed"),
}


def _source(tmp: Path, name: str, v: int) -> Source:
    """The source as the training command builds it from ``data.synthetic``."""
    generator, node, _ = SOURCES[name]
    return source_of({"generator": f"seg_at_scale.data.sources.{generator}",
                      "splits": {"train": 1}, **node(v), "options": _inputs(tmp, name)})


def _build(tmp: Path, root: Path, name: str, v: int, overwrite: bool) -> None:
    _source(tmp, name, v).build(root, overwrite=overwrite)


def _state(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_source_reuses_refuses_and_rebuilds_the_same_way(tmp_path, name):
    key = SOURCES[name][2]
    root = tmp_path / "data"

    def build(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
        _build(tmp, root, name, v, overwrite)

    build(tmp_path, root, 0, False)
    made = _state(root)
    assert any(k.endswith("_image.tif") for k in made) and "manifest.json" in made
    build(tmp_path, root, 0, False)  # same parameters: reused, nothing written
    assert _state(root) == made
    with pytest.raises(InputError, match=rf"{name.split('_')[0]}.*holds a dataset made with "
                                         rf"other parameters \({key}: .* there, .* asked\); "
                                         "pass overwrite=true"):
        build(tmp_path, root, 1, False)
    assert _state(root) == made  # refused before writing anything
    build(tmp_path, root, 1, True)
    assert _state(root) != made
    build(tmp_path, root, 1, False)  # the rebuilt folder is reused in turn
    assert _state(root) == (rebuilt := _state(root))
    build(tmp_path, root, 0, True)  # back: the scenes only the other dataset had are gone
    assert set(_state(root)) == set(made) and _state(root) != rebuilt


@pytest.mark.parametrize("name", ["synthetic", "streets", "cosmic"])
def test_every_generator_seeds_scene_k_of_a_split_by_the_one_rule(tmp_path, name, monkeypatch):
    source = _source(tmp_path, name, 7)
    source.splits = {"train": 2, "val": 1}
    seen: list[tuple[str, str, int]] = []
    write = type(source).write
    monkeypatch.setattr(type(source), "write", lambda self, folder, scene, seed: (
        seen.append((folder.name, scene, seed)), write(self, folder, scene, seed)))
    source.build(tmp_path / name)
    assert [(split, seed) for split, _, seed in seen] == [
        ("train", scene_seed(7, "train", 0)), ("train", scene_seed(7, "train", 1)),
        ("val", scene_seed(7, "val", 0))]
    assert len({seed for _, _, seed in seen}) == 3


def test_a_generator_that_is_no_source_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data.synthetic.generator='os.path.join' is not a "
                                        r"class: name a seg_at_scale.data.sources.base.Source"):
        source_of({"generator": "os.path.join", "splits": {"train": 1}})
    with pytest.raises(ConfigError, match=r"data.synthetic.generator='pathlib.Path' is not a "
                                        r"dataset source"):
        source_of({"generator": "pathlib.Path", "splits": {"train": 1}})
    with pytest.raises(ConfigError, match=r"do not fit Streets\(splits.*unexpected keyword "
                                          r"argument 'colour'"):
        source_of({"generator": "seg_at_scale.data.sources.streets.Streets",
                   "splits": {"train": 1}, "height": 8, "width": 8, "options": {"colour": 1}})


def test_seg_train_rebuilds_another_dataset_only_with_data_synthetic_overwrite(tmp_path):
    node = {"enabled": True, "overwrite": False,
            "generator": "seg_at_scale.data.sources.streets.Streets",
            "splits": {"train": 1}, "height": 24, "width": 40, "seed": 0}
    make_synthetic(str(tmp_path / "d"), node)
    made = _state(tmp_path / "d")
    with pytest.raises(InputError, match=r"\(seed: 0 there, 1 asked\); pass overwrite=true "
                                         r"\(seg-train: data.synthetic.overwrite=true; "
                                         r"seg-synth: --overwrite\)"):
        make_synthetic(str(tmp_path / "d"), {**node, "seed": 1})
    assert _state(tmp_path / "d") == made
    make_synthetic(str(tmp_path / "d"), {**node, "seed": 1, "overwrite": True})
    assert set(_state(tmp_path / "d")) == set(made) and _state(tmp_path / "d") != made


def test_a_class_count_other_than_the_source_table_is_refused_before_writing(tmp_path):
    node = {"enabled": True, "generator": "seg_at_scale.data.sources.streets.Streets",
            "splits": {"train": 1}, "height": 24, "width": 40, "seed": 0}
    with pytest.raises(ConfigError, match=r"data.num_classes=5 but streets's class table has 7 "
                                          r"classes \(road, sidewalk, building, vegetation, "
                                          r"\.\.\.\): set data.num_classes=7"):
        make_synthetic(str(tmp_path / "d"), node, num_classes=5)
    assert not (tmp_path / "d").exists()
    make_synthetic(str(tmp_path / "d"), node, num_classes=7)
    assert (tmp_path / "d" / "manifest.json").exists()


def test_a_folder_of_the_users_scenes_in_either_layout_is_not_built_into(tmp_path):
    node = {"enabled": True, "generator": "seg_at_scale.data.sources.streets.Streets",
            "splits": {"train": 1}, "height": 24, "width": 40, "seed": 0}
    for layout in (["train/a_image.tif", "train/a_mask.tif"],
                   ["train/images/a.tif", "train/masks/a.tif"]):
        root = tmp_path / layout[1].split("/")[1].split(".")[0]
        for name in layout:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(b"mine")
        with pytest.raises(OutputExistsError, match=rf"'{root}' holds scene files "
                                                    r"\(a\w*.tif, ...\) but no manifest.json"):
            make_synthetic(str(root), node)
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.tif")) == \
            sorted(layout)


def test_a_data_root_that_is_a_url_is_refused_before_a_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    node = {"enabled": True, "generator": "seg_at_scale.data.sources.streets.Streets",
            "splits": {"train": 1}, "height": 24, "width": 40, "seed": 0}
    for root, kind in [("s3://bucket/scenes", r"a URL \(s3:\)"),
                       ("/vsis3/bucket/scenes", "a GDAL virtual path")]:
        with pytest.raises(ConfigError, match=rf"data.root='{root}' is {kind}: seg_at_scale "
                                              r"reads and writes local files only .* copy it "
                                              r"to a local or mounted folder first"):
            make_synthetic(root, node)
        with pytest.raises(ConfigError, match=rf"data.root='{root}' is {kind}"):
            make_synthetic(root, {**node, "enabled": False})  # a folder of the user's own
    assert sorted(tmp_path.iterdir()) == []  # no 's3:' folder made here


@pytest.mark.parametrize("name", ["cosmic_h5", "cityscapes"])
def test_a_converted_folder_is_reused_without_its_source(tmp_path, name):
    _build(tmp_path, tmp_path / "data", name, 0, False)
    made = _state(tmp_path / "data")
    again = _source(tmp_path, name, 0)
    (tmp_path / ("events.h5" if name == "cosmic_h5" else "cs")).rename(tmp_path / "moved")
    again.build(tmp_path / "data")  # the source is gone: the manifest alone says "reuse"
    assert _state(tmp_path / "data") == made


def test_class_names_null_takes_the_sources_class_table(tmp_path):
    """Before: data=taco (class_names: null) logged and recorded class_0, class_1, ...
    although annotations.json names every category."""
    from omegaconf import OmegaConf

    from seg_at_scale.cli.data_setup import synthesize

    write_taco(tmp_path / "taco")
    node = {"enabled": True, "generator": "seg_at_scale.data.sources.taco.Taco",
            "splits": {"train": 1}, "height": None, "width": None, "seed": 0,
            "options": {"source": str(tmp_path / "taco"), "classes": "category"}}
    cfg = OmegaConf.create({"data": {"root": str(tmp_path / "ds"), "num_classes": 4,
                                     "class_names": None, "synthetic": node}})
    OmegaConf.set_struct(cfg, True)
    synthesize(cfg)
    assert list(cfg.data.class_names) == ["background", "Bottle cap", "Glass bottle",
                                          "Plastic bottle"]  # by category id
    cfg.data.class_names = ["bg", "a", "b", "c"]  # the user's own names are kept
    synthesize(cfg)
    assert list(cfg.data.class_names) == ["bg", "a", "b", "c"]
