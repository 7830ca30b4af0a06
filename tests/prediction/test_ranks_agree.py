"""A refusal rank 0 finds for every rank (the output is another prediction's) is raised on
every rank at the same point, so an archive's ranks skip that scene together.

Before, rank 0 raised alone and the other ranks waited for it in a broadcast: in a
multi-rank archive of a two-pass model (scene by scene, every rank on each scene) the ranks
then fell out of step on the next scene, or hung.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from seg_at_scale.errors import SegAtScaleError  # noqa: E402
from seg_at_scale.io import write_raster  # noqa: E402
from seg_at_scale.models.gscnn import GSCNN  # noqa: E402
from seg_at_scale.parallel.launch import spawn  # noqa: E402
from seg_at_scale.prediction import PredictOptions, predict_raster  # noqa: E402
from seg_at_scale.prediction.raster import raised_everywhere  # noqa: E402


def tiny() -> GSCNN:
    import torch

    torch.manual_seed(0)
    return GSCNN.from_preset("tiny", in_channels=4, num_classes=3)


def _predict(rank: int, world: int, image: str, output: str, report: str) -> None:
    try:
        predict_raster(tiny().eval(), image, output, PredictOptions(tile_size=400, progress=False))
        res = "done"
    except SegAtScaleError as exc:
        res = f"{type(exc).__name__}|{raised_everywhere(exc)}|{exc}"
    Path(f"{report}.{rank}").write_text(res)


def test_another_predictions_output_is_refused_on_every_rank(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, (4, 403, 421)).astype(np.uint8)
    image = write_raster(tmp_path / "scene.tif", raw, tile=(64, 64))
    output = tmp_path / "labels.tif"
    predict_raster(tiny().eval(), image, output, PredictOptions(tile_size=520, progress=False))
    before = output.read_bytes()  # another tiling: another prediction's output
    spawn(_predict, 2, str(image), str(output), str(tmp_path / "rank"), threads=1)
    for rank in (0, 1):
        kind, everywhere, message = (tmp_path / f"rank.{rank}").read_text().split("|", 2)
        assert (kind, everywhere) == ("OutputExistsError", "True"), message
        assert "was made by another prediction" in message and str(output) in message
    assert output.read_bytes() == before
