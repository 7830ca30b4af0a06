"""The prediction functions as a notebook calls them: what they refuse, before any file."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.prediction import NORM, make_image, make_model, make_run

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import InputError
from seg_at_scale.io import read_raster
from seg_at_scale.models.trained import load_run
from seg_at_scale.prediction import predict_raster
from seg_at_scale.prediction.options import PredictOptions
from seg_at_scale.prediction.scene import predict_scene


@pytest.mark.parametrize("values, said", [
    ({"std": (0.0,)}, r"^normalization std has 0.0 for band 0: a standard deviation divides "
                      r"the band, so it must be > 0"),
    ({"std": (0.25, float("nan"))}, r"^normalization std has nan for band 1"),
    ({"mean": (float("inf"),)}, r"^normalization mean has inf for band 0: give a finite value"),
    ({"scale": 0.0}, r"^normalization scale has 0.0: give a finite, non-zero value"),
])
def test_a_normalisation_that_gives_no_input_is_refused(values, said):
    """Before: ``std=0`` was taken, and predict_raster wrote class 0 over the whole scene
    with a numpy warning at most."""
    with pytest.raises(InputError, match=said):
        Normalizer(**values)


def test_inputs_that_do_not_fit_the_network_are_refused_before_anything_is_written(tmp_path):
    """Before: a normalisation of other bands was refused at the first tile, leaving the
    working store; an image of other bands gave torch's words from inside the probe."""
    net, image = make_model(), make_image(tmp_path / "scene.tif", 61, 53)
    three = Normalizer(1 / 255, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    with pytest.raises(InputError, match=r"^normalization has 3 means / 3 stds for 4 bands"):
        predict_raster(net, image, tmp_path / "a.tif", PredictOptions(progress=False),
                       normalizer=three)
    rgb = make_image(tmp_path / "rgb.tif", 61, 53)
    with pytest.raises(InputError, match=r"^the network cannot run on the image's 3 bands \("):
        predict_raster(net, _bands(rgb, 3), tmp_path / "b.tif", PredictOptions(progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rgb.tif", "rgb3.tif", "scene.tif"]


def _bands(image, n):
    from seg_at_scale.io import write_raster

    return write_raster(image.with_name(f"{image.stem}{n}.tif"), read_raster(image)[:n])


def test_predict_scene_takes_paths_as_strings_and_default_options(tmp_path):
    """Before: ``str`` paths and ``options=None`` failed with AttributeError deep inside."""
    trained = load_run(make_run(tmp_path / "run", make_model()))
    image = make_image(tmp_path / "scene.tif", 61, 53)
    res = predict_scene(trained, str(image), str(tmp_path / "a.tif"))
    ref = predict_scene(trained, image, tmp_path / "b.tif", PredictOptions())
    assert res["class_pixels"] == ref["class_pixels"] and sum(res["class_pixels"]) == 61 * 53
    np.testing.assert_array_equal(read_raster(tmp_path / "a.tif"), read_raster(tmp_path / "b.tif"))
    with pytest.raises(TypeError, match=r"options is a dict; give a PredictOptions"):
        predict_scene(trained, image, tmp_path / "c.tif", {"q": 2})  # type: ignore[arg-type]
    assert NORM  # the run's normalisation: the helpers' (mean 0.5, std 0.25)
