"""Class weights from label frequencies, with a power: 0 = none, 1 = inverse frequency.

``w_k = (N / (K' n_k)) ** p`` for every class present in the training masks (``n_k`` its
pixels, ``N`` all labelled pixels, ``K'`` the classes present), 1 for a class absent from
them. ``p = 1`` gives each present class the same total weight; ``p = 0.5`` is the inverse
square-root frequency; ``p = 0`` is the unweighted loss. The same weights feed the loss and
the grid mode's whole-image normaliser (``data.class_weights``), so tiled training stays
exact.

>>> frequency_weights([600, 300, 100], power=1.0)
[0.5556, 1.1111, 3.3333]
>>> frequency_weights([600, 300, 0], power=0.5)
[0.866, 1.2247, 1.0]
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from seg_at_scale.errors import ConfigError

__all__ = ["frequency_weights", "scene_class_weights"]


def frequency_weights(counts: Sequence[int], power: float) -> list[float]:
    """Per-class weights ``(N / (K' n_k)) ** power`` (1 for absent classes), 4 decimals."""
    if not (isinstance(power, (int, float)) and 0.0 <= power <= 2.0):
        raise ConfigError(f"data.class_weight_power={power!r}: use a number in [0, 2] "
                          "(0 = unweighted, 0.5 = inverse sqrt frequency, 1 = inverse frequency)")
    total = float(sum(counts))
    present = sum(1 for n in counts if n > 0)
    if present == 0:
        return [1.0] * len(counts)
    return [round((total / (present * n)) ** power, 4) if n > 0 else 1.0 for n in counts]


def scene_class_weights(root: str | os.PathLike[str], num_classes: int, ignore_index: int,
                        power: float | None) -> list[float] | None:
    """Weights from the class counts of ``<root>/train``'s masks; None when ``power`` is None or 0.

    Args:
        root: the dataset folder (``data.root``), holding ``train/``'s scenes.
        num_classes: K.
        ignore_index: label that counts for no class.
        power: the exponent ``p`` (``data.class_weight_power``).
    """
    if power is None or (isinstance(power, (int, float)) and not isinstance(power, bool)
                         and power == 0):
        return None
    from seg_at_scale.data.scenes import class_histogram, find_scenes
    from seg_at_scale.io import RasterReader

    counts = [0] * num_classes
    for scene in find_scenes(Path(root) / "train", key="data.root"):
        assert scene.mask is not None
        with RasterReader(scene.mask) as mask:
            for k, n in enumerate(class_histogram(mask, num_classes, ignore_index)):
                counts[k] += n
    weights = frequency_weights(counts, float(power))
    return weights if not all(math.isclose(w, 1.0) for w in weights) else None
