"""CosmicTagger data: the real larcv3 HDF5 files (read with h5py alone) and synthetic events.

Both become scenes in the project's on-disk layout, so the ordinary tile machinery trains
on them: ``<root>/<split>/event_<k>_image.tif`` holds the P wire planes as P float32 bands
``[P, H, W]`` (charge), and ``event_<k>_mask.tif`` the per-plane labels as P uint8 bands
(0 background, 1 cosmic, 2 neutrino; ``data.mask_bands: 3``).

Real file layout (larcv3): in ``Data/sparse2d_<producer>_group``, event ``e`` owns the
projections ``extents[e] = (first, N)``; projection ``j`` has ``image_meta[j]``
(``number_of_voxels = (n0, n1)``) and the voxels ``voxels[voxel_extents[j].first :
... + N]`` of ``(id, value)``, flat index ``id = i0 * n1 + i1`` (C order). A plane is
returned as ``[n1, n0]`` (1280 x 2048 for SBND): rows along the second meta axis, wires
along columns. Pixels without a voxel are 0 (image) and background (label).

``downsample = f`` pools ``f x f`` blocks: images by **max** (keeps the charge scale of a
track, so one normalisation serves every resolution) and labels by **max**, which is the
priority neutrino (2) > cosmic (1) > background (0).

>>> ev = synthetic_event(64, 96, seed=1)
>>> ev.image.shape, ev.labels.dtype, int(ev.labels.max())
((3, 64, 96), dtype('uint8'), 2)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from seg_at_scale.data.sources.base import Source
from seg_at_scale.errors import InputError

__all__ = ["CosmicEvent", "read_cosmic_h5", "count_events", "densify", "downsample_event",
           "synthetic_event", "CosmicEvents", "CosmicH5", "CLASS_NAMES",
           "IMAGE_GROUP", "LABEL_GROUP"]

CLASS_NAMES = ("background", "cosmic", "neutrino")
IMAGE_GROUP = "Data/sparse2d_sbndwire_group"
LABEL_GROUP = "Data/sparse2d_sbnd_cosmicseg_group"
GENERATOR_VERSION = 2  # 2: event seeds from the one rule (sources.base.scene_seed)
_GIVE = ("give data.synthetic.options.path (or the COSMIC_H5 variable) the path of a "
         "CosmicTagger larcv3 .h5 file")
PLANE_ANGLES = (0.0, np.pi / 3, -np.pi / 3)  # wire directions: collection, two induction


@dataclass
class CosmicEvent:
    """One event: ``image [P, H, W]`` float32 charge, ``labels [P, H, W]`` uint8."""

    image: np.ndarray
    labels: np.ndarray


# ----- the real larcv3 file ---------------------------------------------------------------


def _group(f: Any, path: Path, name: str) -> Any:
    if name not in f:
        raise InputError(f"'{path}' has no group '{name}': not a CosmicTagger larcv3 file "
                         f"(expected {IMAGE_GROUP} and {LABEL_GROUP}); {_GIVE}")
    return f[name]


def count_events(path: str | os.PathLike[str]) -> int:
    """Number of events in a larcv3 file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"CosmicTagger file '{p}' does not exist; {_GIVE}")
    with _open(p) as f:
        return len(_group(f, p, IMAGE_GROUP)["extents"])


def _open(path: Path) -> Any:
    """``path`` opened by h5py, or its refusal naming the key."""
    import h5py

    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise InputError(f"'{path}' is not an HDF5 file ({err}); {_GIVE}") from None


def densify(group: Any, event: int) -> np.ndarray:
    """Dense ``[P, n1, n0]`` float32 planes of one event of a sparse2d group (see module doc)."""
    first, n = (int(v) for v in group["extents"][event])
    metas = group["image_meta"][first : first + n]
    extents = group["voxel_extents"][first : first + n]
    planes = []
    for meta, ext in zip(metas, extents):
        n0, n1 = (int(v) for v in meta["number_of_voxels"])
        vox = group["voxels"][int(ext["first"]) : int(ext["first"]) + int(ext["N"])]
        if len(vox) and int(vox["id"].max()) >= n0 * n1:
            raise InputError(f"{group.name}: event {event} has voxel id {int(vox['id'].max())} "
                             f"beyond its {n0} x {n1} image; the file is corrupt")
        flat = np.zeros(n0 * n1, np.float32)
        flat[vox["id"].astype(np.int64)] = vox["value"]
        planes.append(flat.reshape(n0, n1).T)
    if len({p.shape for p in planes}) != 1:
        raise InputError(f"{group.name}: event {event} has planes of different sizes "
                         f"{[p.shape for p in planes]}")
    return np.stack(planes)


def read_cosmic_h5(path: str | os.PathLike[str], events: Sequence[int] | None = None, *,
                   downsample: int = 1) -> Iterator[CosmicEvent]:
    """Dense events of a CosmicTagger larcv3 file, one at a time.

    Args:
        path: the ``.h5`` file.
        events: event indices (default: all).
        downsample: pooling factor ``f`` (module docstring); sizes must divide by it.

    Yields:
        :class:`CosmicEvent` with ``image`` and ``labels`` of shape ``[P, H / f, W / f]``.
    """
    p = Path(path)
    total = count_events(p)
    chosen = list(range(total)) if events is None else [int(e) for e in events]
    for e in chosen:
        if not 0 <= e < total:
            raise InputError(f"event {e} is not in '{p}' ({total} events: 0..{total - 1})")
    with _open(p) as f:
        images, labels = _group(f, p, IMAGE_GROUP), _group(f, p, LABEL_GROUP)
        for e in chosen:
            lab = densify(labels, e)
            if lab.max(initial=0) > 2 or lab.min(initial=0) < 0:
                raise InputError(f"'{p}' event {e}: label {lab.max()} outside 0..2 "
                                 "(background, cosmic, neutrino)")
            yield downsample_event(CosmicEvent(densify(images, e), lab.astype(np.uint8)),
                                   downsample)


def downsample_event(event: CosmicEvent, factor: int) -> CosmicEvent:
    """Max-pool image and labels over ``factor x factor`` blocks (label max = priority)."""
    if factor == 1:
        return event
    p, h, w = event.image.shape
    if factor < 1 or h % factor or w % factor:
        raise InputError(f"data.synthetic.options.downsample={factor} does not divide the "
                         f"{h} x {w} planes; use a factor that divides both sides (1, 2, 4, ...)")

    def pool(a: np.ndarray) -> np.ndarray:
        return a.reshape(p, h // factor, factor, w // factor, factor).max(axis=(2, 4))

    return CosmicEvent(pool(event.image), pool(event.labels))


# ----- synthetic events -------------------------------------------------------------------


def _project(points: np.ndarray, angle: float) -> np.ndarray:
    """3-D points ``[n, 3]`` (x drift, y up, z beam; unit box) -> ``[n, 2]`` (row, wire)."""
    u = points[:, 2] * np.cos(angle) + points[:, 1] * np.sin(angle)
    lo = min(0.0, np.sin(angle)) + 0.0
    hi = np.cos(angle) + max(0.0, np.sin(angle))
    return np.stack([points[:, 0], (u - lo) / (hi - lo)], axis=1)


def _clip_to_box(start: np.ndarray, direction: np.ndarray, length: float) -> np.ndarray:
    """End point of a segment from ``start``, cut where it leaves the unit box."""
    t = length
    for k in range(3):
        if direction[k] > 1e-9:
            t = min(t, (1 - start[k]) / direction[k])
        elif direction[k] < -1e-9:
            t = min(t, -start[k] / direction[k])
    return start + max(t, 0.0) * direction


def _segments(rng: np.random.Generator, cosmics: float) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """3-D segments ``(start, end, class)``: cosmic muons, then the neutrino interaction."""
    segs = []
    for _ in range(rng.poisson(cosmics)):  # enter through the top, cross the whole box
        start = np.array([rng.random(), 1.0, rng.random()])
        d = rng.normal(size=3)
        d[1] = -abs(d[1]) - 0.3
        d /= np.linalg.norm(d)
        segs.append((start, _clip_to_box(start, d, 10.0), 1))
    vertex = rng.uniform(0.25, 0.75, size=3)
    for _ in range(rng.integers(2, 6)):  # short prongs from the vertex, some branching
        d = rng.normal(size=3)
        d /= np.linalg.norm(d)
        end = _clip_to_box(vertex, d, rng.uniform(0.04, 0.2))
        segs.append((vertex, end, 2))
        for _ in range(rng.integers(0, 3) if rng.random() < 0.5 else 0):
            d2 = d + rng.normal(scale=0.8, size=3)
            d2 /= np.linalg.norm(d2)
            segs.append((end, _clip_to_box(end, d2, rng.uniform(0.02, 0.08)), 2))
    return segs


def _draw(image: np.ndarray, labels: np.ndarray, a: np.ndarray, b: np.ndarray, cls: int,
          rng: np.random.Generator) -> None:
    """Rasterise the 2-D segment ``a -> b`` (unit coordinates) into one plane."""
    h, w = image.shape
    scale = np.array([h - 1, w - 1])
    pa, pb = a * scale, b * scale
    n = int(np.abs(pb - pa).max() * 2) + 2
    pts = np.rint(pa + np.linspace(0, 1, n)[:, None] * (pb - pa)).astype(np.int64)
    pts = np.unique(pts, axis=0)
    charge = rng.gamma(4.0, 8.0, size=len(pts)).astype(np.float32)  # mean 32, Landau-ish tail
    np.maximum.at(image, (pts[:, 0], pts[:, 1]), charge)
    np.maximum.at(labels, (pts[:, 0], pts[:, 1]), np.uint8(cls))


def synthetic_event(height: int, width: int, seed: int | Sequence[int], *, planes: int = 3,
                    cosmics: float = 8.0, noise: float = 2.0,
                    threshold: float = 5.0) -> CosmicEvent:
    """A detector-like event: consistent views of one 3-D event in ``planes`` wire planes.

    Cosmic muons are long straight tracks entering through the top of the (unit) detector
    box and crossing it; the neutrino interaction is a vertex inside it with 2-5 short
    prongs, half of them branching. Each plane projects the 3-D segments onto its wire
    direction (0, +60, -60 degrees) against the drift coordinate (rows), so the three
    views agree. Charge per pixel is gamma-distributed (the same law for both classes:
    only geometry tells them apart), Gaussian noise is added, and everything below
    ``threshold`` is zeroed (sparse, like the real readout); labels exist only on charge.

    Args:
        height: rows (drift time).
        width: columns (wires).
        seed: an int or a tuple of ints; the event is a pure function of the arguments.
        planes: number of views (at most 3 distinct wire angles, then repeated).
        cosmics: mean number of cosmic muons (Poisson).
        noise: Gaussian noise standard deviation (charge units).
        threshold: zero-suppression threshold.
    """
    rng = np.random.default_rng(seed)
    image = np.zeros((planes, height, width), np.float32)
    labels = np.zeros((planes, height, width), np.uint8)
    for start, end, cls in _segments(rng, cosmics):
        for p in range(planes):
            ends = _project(np.stack([start, end]), PLANE_ANGLES[p % len(PLANE_ANGLES)])
            _draw(image[p], labels[p], ends[0], ends[1], cls, rng)
    image += rng.normal(scale=noise, size=image.shape).astype(np.float32)
    keep = image >= threshold
    return CosmicEvent(np.where(keep, image, 0).astype(np.float32),
                       np.where(keep, labels, 0).astype(np.uint8))


# ----- writers: both sources into the scene layout ---------------------------------------


def _write_event(folder: Path, name: str, event: CosmicEvent) -> None:
    from seg_at_scale.io import write_raster

    folder.mkdir(parents=True, exist_ok=True)
    tile = (256, 256) if min(event.image.shape[1:]) >= 256 else None
    write_raster(folder / f"{name}_image.tif", event.image, tile=tile, overwrite=True)
    write_raster(folder / f"{name}_mask.tif", event.labels, tile=tile, overwrite=True)


class CosmicEvents(Source):
    """Synthetic CosmicTagger-like events as scenes (data=cosmic); needs nothing.

    Events are drawn at ``(height * downsample, width * downsample)`` and pooled by
    ``downsample`` (module docstring), so datasets at several factors hold the same events.
    """

    name = "cosmic"
    classes = CLASS_NAMES

    def __init__(self, splits: Mapping[str, int], height: int, width: int, seed: int = 0, *,
                 downsample: int = 1, planes: int = 3, cosmics: float = 8.0) -> None:
        super().__init__(splits, int(height), int(width), seed)
        self.downsample, self.planes, self.cosmics = downsample, planes, cosmics

    def parameters(self) -> dict[str, Any]:
        return {"generator": "cosmic", "version": GENERATOR_VERSION, "height": self.height,
                "width": self.width, "seed": self.seed, "downsample": self.downsample,
                "planes": self.planes, "cosmics": self.cosmics, "splits": self.splits}

    def plan(self) -> dict[str, list[str]]:
        return {s: [f"event_{k}" for k in range(n)] for s, n in self.splits.items()}

    def write(self, folder: Path, name: str, seed: int) -> None:
        f = self.downsample
        ev = synthetic_event(self.height * f, self.width * f,  # type: ignore[operator]
                             seed=seed, planes=self.planes, cosmics=self.cosmics)
        _write_event(folder, name, downsample_event(ev, f))


class CosmicH5(Source):
    """A larcv3 file's events as scenes (data=cosmic_h5), in file order.

    The first ``splits["train"]`` go to ``train/``, the next to the following split (dict
    order).

    ``height`` / ``width``, when given, are checked against the (downsampled) planes.
    """

    name = "cosmic_h5"
    needs = "the larcv3 file (data.synthetic.options.path)"
    classes = CLASS_NAMES

    def __init__(self, splits: Mapping[str, int], height: int | None = None,
                 width: int | None = None, seed: int = 0, *, path: str | os.PathLike[str],
                 downsample: int = 1) -> None:
        super().__init__(splits, height, width, seed)
        self.path, self.downsample = Path(path), downsample

    def parameters(self) -> dict[str, Any]:
        return {"generator": "cosmic_h5", "path": str(self.path.resolve()),
                "downsample": self.downsample, "splits": self.splits}

    def plan(self) -> dict[str, list[str]]:
        total = count_events(self.path)
        need = sum(self.splits.values())
        if need > total:
            raise InputError(f"data.synthetic.splits asks for {need} events but "
                             f"'{self.path}' holds {total}; lower the split counts")
        names: dict[str, list[str]] = {}
        start = 0
        for s, n in self.splits.items():
            names[s] = [f"event_{e}" for e in range(start, start + n)]
            start += n
        return names

    def write(self, folder: Path, name: str, seed: int) -> None:
        e = int(name.split("_")[1])
        (ev,) = read_cosmic_h5(self.path, [e], downsample=self.downsample)
        size = (self.height, self.width)
        if size != (None, None) and size != ev.image.shape[1:]:
            raise InputError(f"'{self.path}' event {e} is {ev.image.shape[1]} x "
                             f"{ev.image.shape[2]} after downsample={self.downsample}, but "
                             f"data.synthetic.height/width ask for {self.height} x "
                             f"{self.width}; set them to null")
        _write_event(folder, name, ev)
