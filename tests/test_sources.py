"""Every dataset source follows the one folder rule (data/manifest.py): a folder made with
other parameters is refused the same way, naming what differs, and nothing in it changes;
``overwrite`` rebuilds it; the same parameters reuse it without writing."""

from __future__ import annotations

from pathlib import Path

import pytest
from source_fixtures import tiny_event, write_cityscapes, write_larcv, write_taco

from seg_at_scale.data.cityscapes import convert_cityscapes
from seg_at_scale.data.cosmic import convert_cosmic_h5, make_cosmic_dataset
from seg_at_scale.data.streets import make_street_dataset
from seg_at_scale.data.synthetic_dataset import make_dataset
from seg_at_scale.data.taco import convert_taco
from seg_at_scale.errors import InputError


def _synthetic(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
    make_dataset(root, splits={"train": 1}, height=40, width=52, seed=v, overwrite=overwrite)


def _streets(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
    make_street_dataset(root, {"train": 1}, 40, 56, seed=v, overwrite=overwrite)


def _cosmic(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
    make_cosmic_dataset(root, {"train": 1}, 24, 40, seed=v, overwrite=overwrite)


def _cosmic_h5(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
    path = tmp / "events.h5"
    if not path.exists():
        write_larcv(path, [tiny_event(s, (3, 8, 12)) for s in range(3)])
    convert_cosmic_h5(root, {"train": v + 1}, path=path, overwrite=overwrite)


def _cityscapes(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
    source = tmp / "cs"
    if not source.exists():
        write_cityscapes(source, "train", "aachen", 2)
    convert_cityscapes(source, root, {"train": v + 1}, overwrite=overwrite)


def _taco(tmp: Path, root: Path, v: int, overwrite: bool) -> None:
    source = tmp / "taco"
    if not source.exists():
        write_taco(source)
    convert_taco(source, root, {"train": 1}, seed=v, overwrite=overwrite)


SOURCES = {"synthetic": (_synthetic, "seed"), "streets": (_streets, "seed"),
           "cosmic": (_cosmic, "seed"), "cosmic_h5": (_cosmic_h5, "splits"),
           "cityscapes": (_cityscapes, "splits"), "taco": (_taco, "seed")}


def _state(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_source_reuses_refuses_and_rebuilds_the_same_way(tmp_path, name):
    build, key = SOURCES[name]
    root = tmp_path / "data"
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
