"""Scoring a prediction against its mask, streamed by row bands."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile

from seg_at_scale.errors import InputError
from seg_at_scale.metrics import confusion_from_rasters
from seg_at_scale.prediction.store import NODATA  # what a prediction writes without data


def _counts(pred: np.ndarray, truth: np.ndarray, k: int, ignore: int) -> np.ndarray:
    cm = np.zeros((k, k), np.int64)
    for t, p in zip(truth.ravel(), pred.ravel(), strict=True):
        if t != ignore and p != NODATA:
            cm[t, p] += 1
    return cm


@pytest.mark.parametrize("ignore", [254, 255, 7])
def test_no_data_predictions_are_left_out_whatever_the_ignore_index(tmp_path, ignore):
    """Before: with ``data.ignore_index=254`` the no-data predictions (255) were counted as
    a class, and the test scoring failed (cannot reshape array of size 259)."""
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 4, (37, 29)).astype(np.uint8)
    truth[rng.random(truth.shape) < 0.1] = ignore
    pred = rng.integers(0, 4, truth.shape).astype(np.uint8)
    pred[:, :5] = NODATA  # the image's no-data strip, over labelled pixels too
    tifffile.imwrite(tmp_path / "pred.tif", pred)
    tifffile.imwrite(tmp_path / "mask.tif", truth)
    cm = confusion_from_rasters(tmp_path / "pred.tif", tmp_path / "mask.tif", 4, ignore,
                                band_rows=8)
    np.testing.assert_array_equal(cm, _counts(pred, truth, 4, ignore))
    assert cm.sum() == ((truth != ignore) & (pred != NODATA)).sum()


def test_a_mask_label_outside_the_classes_is_named_with_its_file(tmp_path):
    truth = np.zeros((9, 11), np.uint8)
    truth[4, 6] = 5
    tifffile.imwrite(tmp_path / "pred.tif", np.zeros_like(truth))
    tifffile.imwrite(tmp_path / "mask.tif", truth)
    with pytest.raises(InputError) as err:
        confusion_from_rasters(tmp_path / "pred.tif", tmp_path / "mask.tif", 3, 255)
    assert str(err.value) == (
        f"mask '{tmp_path / 'mask.tif'}' has label 5, which is neither a class 0..2 nor "
        "ignore_index=255: score against a mask of this model's classes")
