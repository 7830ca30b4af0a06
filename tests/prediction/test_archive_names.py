"""seg-predict images=: every path any scene writes is unique across the archive.

Scenes ``a.tif`` and ``a_probabilities.tif`` with ``probabilities=uint8``: the second
scene's labels replaced the first scene's probabilities, exit 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.prediction import make_model, make_run, seg_predict_here

from seg_at_scale.errors import InputError
from seg_at_scale.io import example_geotags, write_raster
from seg_at_scale.prediction.archive import archive_scenes
from seg_at_scale.prediction.checks import scene_outputs
from seg_at_scale.prediction.options import PredictOptions

OPTS = ("ckpt=last", "tile_size=96", "progress=false")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("clash") / "run",
                    make_model("same", levels=3, width=8))


def _scene(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 255, (4, 40, 36)).astype(np.uint8)
    return write_raster(path, img, geotags=example_geotags(pixel_size=10.0))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_scene_named_like_another_scenes_probabilities_is_refused_before_any_work(
        run, tmp_path):
    scenes, out = tmp_path / "scenes", tmp_path / "out"
    _scene(scenes / "a.tif", 0)
    _scene(scenes / "a_probabilities.tif", 1)
    before = _tree(tmp_path)
    for extra in ((), ("on_error=skip",)):  # a clash of the archive, not of one scene
        res = seg_predict_here(f"run={run}", *OPTS, f"images={scenes}", f"output_dir={out}",
                               "probabilities=uint8", *extra)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
        assert "Traceback" not in res.stderr
        assert (f"scenes 'a' ('{scenes / 'a.tif'}') and 'a_probabilities' "
                f"('{scenes / 'a_probabilities.tif'}') both use '{out / 'a_probabilities.tif'}' "
                "(the probabilities of 'a', the output of 'a_probabilities'): one would "
                "replace the other and nothing was written; rename one of the two scenes or "
                "pass probabilities=null") in lines[0]
        assert _tree(tmp_path) == before  # not even output_dir


def test_the_same_archive_without_probabilities_has_no_clash(tmp_path):
    scenes = tmp_path / "scenes"
    _scene(scenes / "a.tif")
    _scene(scenes / "a_probabilities.tif")
    found = archive_scenes(str(scenes), tmp_path / "out", options=PredictOptions())
    assert [s.stem for s in found] == ["a", "a_probabilities"]


def test_every_companion_and_another_scenes_mask_are_checked(tmp_path):
    scenes, out, masks = tmp_path / "scenes", tmp_path / "out", tmp_path / "out"
    for stem in ("b", "b_mask"):
        _scene(scenes / f"{stem}.tif")
    _scene(masks / "b_mask.tif")  # b's ground truth, in output_dir: b_mask's output
    with pytest.raises(InputError, match=r"'b_mask' \(.*\) both use '.*out/b_mask.tif' \(the "
                                         r"mask of 'b', the output of 'b_mask'\).*rename one "
                                         r"of the two scenes$"):
        archive_scenes(str(scenes), out, masks=masks, options=PredictOptions())
    # the names come from scene_outputs, the rule the scenes are predicted by
    from seg_at_scale.prediction.archive import scene_writes

    s = archive_scenes(str(scenes), tmp_path / "o2", vector="gpkg", options=PredictOptions(
        probabilities="uint8"))[0]
    writes = scene_writes(s, PredictOptions(probabilities="uint8"))
    assert scene_outputs(s.output, PredictOptions(probabilities="uint8"), s.vector).items() \
        <= writes.items()
    assert {p.name for p in writes.values()} == {
        "b.tif", ".b.tif.zarr", "b_probabilities.tif", "b_preview.png", "b.gpkg",
        "b.stac.json", ".b.gpkg.json"}


def test_a_list_naming_a_url_or_a_gdal_virtual_path_is_refused_by_its_line(tmp_path):
    from seg_at_scale.prediction.archive import find_images

    (tmp_path / "a.tif").write_bytes(b"")
    listed = tmp_path / "scenes.txt"
    listed.write_text("# the archive\na.tif\ns3://bucket/b.tif  # the second\n")
    with pytest.raises(InputError, match=rf"images='{listed}': line 3 's3://bucket/b.tif' is "
                                         r"a URL \(s3:\): .*copy it to a local or mounted"):
        find_images(str(listed))
    listed.write_text("/vsicurl/https://example.org/c.tif\n")
    with pytest.raises(InputError, match="line 1 '/vsicurl/https://example.org/c.tif' is a "
                                         "GDAL virtual path"):
        find_images(str(listed))
    listed.write_text("a.tif\n")
    assert find_images(str(listed)) == [("a", tmp_path / "a.tif")]


def test_a_folder_names_a_scene_pair_by_its_scene_and_keeps_every_other_raster(tmp_path):
    """A pair <name>_image.tif + <name>_mask.tif is one scene, <name>; a lone x_image.tif and
    any other raster stay scenes of their own names: nothing in the folder is dropped."""
    from seg_at_scale.prediction.archive import _mask_of, archive_scenes, find_images

    for name in ("a_image.tif", "a_mask.tif", "b.tif", "c_image.tif", "d_mask.tif"):
        _scene(tmp_path / name)
    assert find_images(str(tmp_path)) == [
        ("a", tmp_path / "a_image.tif"), ("b", tmp_path / "b.tif"),
        ("c_image", tmp_path / "c_image.tif"), ("d_mask", tmp_path / "d_mask.tif")]
    split = tmp_path / "split"
    for name in ("images/e.tif", "masks/e.tif"):
        _scene(split / name)
    assert find_images(str(split)) == [("e", split / "images" / "e.tif")]
    upper = tmp_path / "upper"  # .TIF and .tiff as GIS tools write them: the same rule
    for name in ("f_image.TIF", "f_mask.TIF", "g_image.tiff", "g_mask.tif", "h.TIF"):
        _scene(upper / name)
    assert find_images(str(upper)) == [
        ("f", upper / "f_image.TIF"), ("g", upper / "g_image.tiff"), ("h", upper / "h.TIF")]
    assert [_mask_of(upper, s) for s in ("f", "g", "i")] == [
        upper / "f_mask.TIF", upper / "g_mask.tif", None]
    assert _mask_of(split, "e") == split / "masks" / "e.tif"
    # masks= the images' folder: h.TIF, a scene without truth, was taken as its own truth
    scored = archive_scenes(str(upper), tmp_path / "out", masks=upper)
    assert [s.mask for s in scored] == [upper / "f_mask.TIF", upper / "g_mask.tif", None]
