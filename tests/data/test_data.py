import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.data.samplers import ImageGroupedSampler
from seg_at_scale.data.scenes import Scene, find_scenes, validate_scene
from seg_at_scale.data.tiles import GridTiles, RandomTiles, pad_collate
from seg_at_scale.errors import InputError
from seg_at_scale.io import write_raster
from seg_at_scale.models import UNet
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import extend


def test_mask_size_mismatch_is_named(tmp_path, scene_files):
    img, _ = scene_files(tmp_path, shape=(4, 203, 171))
    write_raster(tmp_path / "a_mask.tif", np.zeros((203, 170), np.uint8), overwrite=True)
    with pytest.raises(InputError, match=r"a_mask.tif' is 203x170 but image .*a_image.tif' "
                                         r"is 203x171"):
        validate_scene(Scene(img, tmp_path / "a_mask.tif"), num_classes=5)


def test_label_out_of_range_is_named(tmp_path, scene_files):
    labels = np.zeros((97, 131), np.uint8)
    labels[40, 77] = 7
    img, msk = scene_files(tmp_path, shape=(3, 97, 131), mask=labels)
    with pytest.raises(InputError, match=r"has label 7 at row 40, col 77, but "
                                         r"data.num_classes=5"):
        validate_scene(Scene(img, msk), num_classes=5)
    labels[40, 77] = 255  # the ignore index is allowed
    write_raster(msk, labels, overwrite=True)
    assert validate_scene(Scene(img, msk), num_classes=5).class_counts[0] == 97 * 131 - 1


def test_missing_mask_and_empty_folder_are_named(tmp_path, scene_files):
    with pytest.raises(InputError, match="does not exist"):
        find_scenes(tmp_path / "nope")
    img, msk = scene_files(tmp_path)
    msk.unlink()
    with pytest.raises(InputError, match=r"has no mask: expected .*a_mask.tif'; every scene "
                       r"of a split is scored against its mask: .*predict_after_fit=false\)$"):
        find_scenes(tmp_path)


def test_a_negative_label_is_named_with_the_ignore_index_fix(tmp_path, scene_files):
    """Before: "labels are class ids >= 0", with no way out named."""
    labels = np.zeros((97, 131), np.int16)
    labels[3, 5] = -1  # an unlabelled pixel as some tools write it
    img, msk = scene_files(tmp_path, shape=(3, 97, 131), mask=labels)
    with pytest.raises(InputError, match=r"has negative label -1; labels are class ids >= 0: "
                                         r"write unlabelled pixels as data.ignore_index"):
        validate_scene(Scene(img, msk), num_classes=5)


@pytest.mark.parametrize("nodata", [None, float("nan"), -9999.0])
def test_non_finite_samples_are_no_data_whatever_the_tag(tmp_path, scene_files, nodata):
    img, msk = scene_files(tmp_path, shape=(2, 61, 67), dtype=np.float32)
    image = np.random.default_rng(0).random((2, 61, 67)).astype(np.float32)
    image[:, 10, 20] = np.nan
    image[1, 30, 40] = np.inf  # one band only: the pixel is still no data
    image[0, 50, 5] = -np.inf
    write_raster(img, image, overwrite=True)
    scene = validate_scene(Scene(img, msk), num_classes=5)
    fp = UNet(2, 5, levels=2, base_width=2, padding="same").footprint()
    ds = GridTiles([scene], fp, Normalizer(1.0), q=1, nodata=nodata)
    target, x = ds[0]["target"], ds[0]["image"]
    assert [int(target[r, c]) for r, c in ((10, 20), (30, 40), (50, 5))] == [255] * 3
    assert torch.isfinite(x).all() and int((target[:61, :67] == 255).sum()) == 3
    assert float(x[0, 30, 40]) == 0.0  # zeroed like the fill: both bands, raw 0 -> 0 here


@pytest.mark.parametrize("padding", ["valid", "same"])
def test_grid_tiles_carry_each_label_once(tmp_path, scene_files, padding):
    img, msk = scene_files(tmp_path, shape=(4, 203, 171))
    scene = validate_scene(Scene(img, msk), num_classes=5)
    fp = UNet(4, 5, levels=3, base_width=2, padding=padding).footprint()
    ds = GridTiles([scene], fp, Normalizer(), q=3)
    labelled = sum(int((ds[i]["target"] != 255).sum()) for i in range(len(ds)))
    assert labelled == 203 * 171 == sum(scene.class_counts)
    assert [bool(ds[i]["last"]) for i in range(len(ds))] == [False] * 8 + [True]
    assert all(float(ds[i]["norm"]) == 203 * 171 for i in range(len(ds)))


@pytest.mark.parametrize("padding", ["valid", "same"])
def test_grid_tiles_give_the_whole_image_gradient(tmp_path, scene_files, padding):
    """The training data path (reader -> tiles -> core targets -> loss / norm) is exact,
    also with a normalisation that moves zero (same padding: the fill is zero *after*
    normalising, as the model's own padding; zero-filling raw pixels was off at borders)."""
    img, msk = scene_files(tmp_path, shape=(4, 141, 117))
    scene = validate_scene(Scene(img, msk), num_classes=5)
    torch.manual_seed(0)
    net = UNet(4, 5, levels=3, base_width=4, padding=padding).double()
    fp, loss = net.footprint(), CrossEntropy(5, [1, 2, 1, 1, 3])
    norm = Normalizer(1 / 255, (0.5,), (0.25,))
    ds = GridTiles([scene], fp, norm, q=2, class_weights=[1, 2, 1, 1, 3])
    for i in range(len(ds)):
        s, _ = loss(net(ds[i]["image"][None].double()), ds[i]["target"][None])
        (s / ds[i]["norm"]).backward()
    tiled = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    from seg_at_scale.io import read_raster
    x = torch.from_numpy(norm(read_raster(img)))[None].double()
    t = torch.from_numpy(read_raster(msk).astype(np.int64))
    s, w = loss(net(extend(x, fp))[..., :141, :117], t)
    (s / w).backward()
    for p, g in zip(net.parameters(), tiled):
        assert (p.grad - g).norm() <= 1e-10 * p.grad.norm()


def test_random_tiles_are_reproducible_and_aligned(tmp_path, scene_files):
    img, msk = scene_files(tmp_path, shape=(4, 203, 171))
    scene = validate_scene(Scene(img, msk), num_classes=5)
    fp = UNet(4, 5, levels=3, base_width=2, padding="same").footprint()
    a = RandomTiles([scene], fp, Normalizer(), core=64, samples_per_epoch=4, seed=3)
    b = RandomTiles([scene], fp, Normalizer(), core=64, samples_per_epoch=4, seed=3)
    for i in (0, 5, 11):
        assert torch.equal(a[i]["image"], b[i]["image"])
        assert torch.equal(a[i]["target"], b[i]["target"])
        assert int((a[i]["target"] != 255).sum()) <= 64 * 64
    batch = pad_collate([a[i] for i in range(6)])
    assert batch["image"].shape[0] == 6 and batch["image"].shape[-1] % fp.align == 0


def test_random_tile_augmentation_does_not_depend_on_workers(tmp_path, scene_files):
    """Each DataLoader worker holds a copy of the albumentations pipeline: without a
    per-sample seed, worker 0's k-th sample and worker 1's k-th sample got the same flips."""
    from torch.utils.data import DataLoader

    from seg_at_scale.data.transforms import build_augment

    img, msk = scene_files(tmp_path, shape=(4, 203, 171))
    scene = validate_scene(Scene(img, msk), num_classes=5)
    fp = UNet(4, 5, levels=3, base_width=2, padding="same").footprint()
    aug = build_augment(flips=True, rotate90=True, brightness=0, contrast=0, seed=0)
    ds = RandomTiles([scene], fp, Normalizer(), core=64, samples_per_epoch=12, seed=3,
                     transform=aug)
    plain = RandomTiles([scene], fp, Normalizer(), core=64, samples_per_epoch=12, seed=3)

    def images(workers: int) -> list[torch.Tensor]:
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        return [b["image"] for b in loader]

    one, two = images(0), images(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    changed = [not torch.equal(one[i], plain[i]["image"]) for i in range(12)]
    assert 3 <= sum(changed) <= 11  # augmented, but not every sample the same way
    # the ops applied: which of the 8 flips/rotations maps the plain window onto the sample
    def op(i: int) -> int:
        x = plain[i]["image"]
        cands = [torch.rot90(x, r, (1, 2)) for r in range(4)]
        cands += [torch.rot90(x.flip(2), r, (1, 2)) for r in range(4)]
        return next(k for k, c in enumerate(cands) if c.shape == one[i].shape
                    and torch.allclose(c, one[i]))
    ops = [op(i) for i in range(12)]
    pairs = [(ops[2 * j], ops[2 * j + 1]) for j in range(6)]  # what 2 workers drew together
    assert any(a != b for a, b in pairs) and len(set(ops)) >= 3


def test_plane_labels_move_with_the_image_under_every_flip_and_rotation():
    """Before: labels of M planes ``[M, h, w]`` (``data=cosmic``, ``mask_bands: 3``) with
    ``tiling=random``'s augmentation failed in albumentations ("Height and Width of image,
    mask or masks should be equal"). Each plane's labels must move as the image does."""
    from seg_at_scale.data.transforms import build_augment

    rng = np.random.default_rng(1)
    image = rng.random((3, 40, 40), dtype=np.float32)
    labels = rng.integers(0, 3, (3, 40, 40)).astype(np.int64)
    inside = np.ones((40, 40), bool)
    inside[:5] = False
    seen = set()
    for seed in range(24):
        aug = build_augment(flips=True, rotate90=True, brightness=0, contrast=0, seed=0)
        aug.reseed(seed)
        x, y, moved = aug(image, labels, inside)
        assert y.shape == labels.shape and y.dtype == labels.dtype
        ops = [lambda a, r=r, f=f: np.rot90(a[..., ::-1] if f else a, r, (-2, -1))
               for f in (False, True) for r in range(4)]
        k = next(i for i, o in enumerate(ops) if np.array_equal(o(image), x))
        seen.add(k)
        np.testing.assert_array_equal(y, ops[k](labels))  # every plane, the image's move
        np.testing.assert_array_equal(moved, ops[k](inside))
    assert len(seen) >= 4


def test_grouped_sampler_keeps_images_together():
    s = ImageGroupedSampler([[0, 1, 2], [3, 4], [5]], shuffle=True, seed=1)
    order = list(s)
    assert sorted(order) == list(range(6))
    runs = [order[i:i + 3] for i in range(len(order))]
    assert [0, 1, 2] in runs
    assert any(order[i:i + 2] == [3, 4] for i in range(5))


def test_importing_the_augmentations_asks_no_server():
    """albumentations looks up its latest release on PyPI when imported (a 2 s timeout per
    process, offline too); importing the project's augmentations resolves no host name."""
    code = ("import socket\n"
            "asked = []\n"
            "def refuse(host, *a, **k):\n"
            "    asked.append(host)\n"
            "    raise OSError('offline')\n"
            "socket.getaddrinfo = refuse\n"
            "import seg_at_scale.data.transforms\n"
            "print('asked', asked)\n")
    env = {k: v for k, v in os.environ.items() if k != "NO_ALBUMENTATIONS_UPDATE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "asked []" in out.stdout, out.stdout
