import numpy as np
import pytest

from seg_at_scale.tiling import Footprint, TilingError, make_grid, random_core, split_axis
from seg_at_scale.tiling.geometry import source_indices

VALID = Footprint(halo=92, align=16, padding="valid", out_residue=4)
SAME = Footprint(halo=94, align=16, padding="same")


@pytest.mark.parametrize("fp", [VALID, SAME, Footprint(22, 4, "same"), Footprint(20, 4, "valid")])
@pytest.mark.parametrize("height,width", [(611, 733), (176, 208), (97, 131)])
@pytest.mark.parametrize("q", [1, 2, 3])
def test_cores_partition_the_image_and_windows_are_aligned(fp, height, width, q):
    try:
        grid = make_grid(height, width, fp, q=q)
    except TilingError:
        assert max(fp.output_length(height), fp.output_length(width)) // fp.align < q
        return
    cover = np.zeros((height, width), dtype=int)
    for t in grid:
        cover[t.core.slices()] += 1
        assert t.read.row % fp.align == (-fp.context) % fp.align or fp.padding == "same"
        assert (t.read.row + fp.context * (fp.padding == "valid")) % fp.align == 0
        assert (t.core.row - t.crop.row - t.read.row) == 0 or fp.padding == "valid"
        if fp.padding == "valid":  # window = computed output + 2 halo, output size allowed
            out = t.read.height - 2 * fp.halo
            assert out % fp.align == fp.out_residue and out >= t.core.height
        else:  # same: at least `context` pixels around the core unless at the extended edge
            assert t.core.row - t.read.row in (fp.context, t.core.row)
            assert t.read.row % fp.align == 0 and t.read.height % fp.align == 0
    assert (cover == 1).all()
    assert grid.shape == (q, q)
    assert grid.efficiency >= 1.0


def test_efficiency_matches_the_seed_formula():
    # 10000 x 10000, q = 8, eps = 92 (same padding rounds to 96): E ~ 1 + q*4*eps/N
    grid = make_grid(10000, 10000, Footprint(92, 16, "same"), q=8)
    n, q, eps = 10000, 8, 96
    interior = (1 + 2 * q * eps / n) ** 2  # every tile padded on both sides
    assert 1 + q * 4 * eps / n * 0.8 < grid.efficiency <= interior


def test_tile_size_bounds_every_window():
    grid = make_grid(1000, 777, SAME, tile_size=400)
    assert all(t.read.height <= 400 and t.read.width <= 400 for t in grid)
    grid = make_grid(1000, 777, VALID, tile_size=400)
    assert all(t.read.height <= 400 and t.read.width <= 400 for t in grid)


def test_edge_tiles_read_no_context_past_the_edge_so_fewer_tiles_cover_the_image():
    """Same padding: one tile covers up to ``tile`` pixels, two up to 2 (tile - context)."""
    ctx = SAME.context  # 96
    one = make_grid(700, 577, SAME, tile_size=704)
    assert one.shape == (1, 1) and one.efficiency < 1.1
    two = make_grid(2 * (700 - ctx) - 48, 577, SAME, tile_size=700)
    assert two.shape == (2, 1)
    assert all(t.read.height <= 700 for t in two)
    assert make_grid(2 * (700 - ctx) + 64, 577, SAME, tile_size=700).shape[0] == 3
    # below the 2 context + align an inner tile needs, a scene that fits is still one tile
    assert make_grid(150, 141, SAME, tile_size=160).shape == (1, 1)
    with pytest.raises(TilingError, match="tile_size=160 leaves no core"):
        make_grid(170, 141, SAME, tile_size=160)
    # valid padding reads the halo everywhere (reflect-extended): the count stands
    a, c = VALID.align, VALID.context
    core = (400 - 2 * c - VALID.out_residue % a) // a * a
    want = tuple(-(-(VALID.output_length(n) // a) // (core // a)) for n in (1000, 777))
    assert make_grid(1000, 777, VALID, tile_size=400).shape == want


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"q": 40}, "q=40 cannot tile height (611)"),
        ({"tile_size": 200}, "tile_size=200 leaves no core"),
        ({}, "give exactly one of q"),
    ],
)
def test_bad_tiling_is_explained(kwargs, message):
    with pytest.raises(TilingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_grid(611, 733, VALID, **kwargs)


def test_split_axis_docstring_example():
    assert split_axis(100, Footprint(halo=5, align=4), parts=3) == [
        (0, 32, 0, 40), (32, 64, 24, 72), (64, 100, 56, 100)]


@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_reflect_indices_match_numpy_pad(size):
    a = np.arange(size)
    pad = 3 * size + 2
    ref = np.pad(a, pad, mode="reflect")
    got = source_indices(-pad, size + 2 * pad, size, Footprint(1, 1, "valid"))
    np.testing.assert_array_equal(a[got], ref)


@pytest.mark.parametrize("fp", [VALID, SAME])
def test_random_core_is_aligned_and_inside(fp):
    rng = np.random.default_rng(0)
    for _ in range(50):
        t = random_core(611, 733, fp, 200, tuple(rng.random(2)))
        assert t.core.row % fp.align == 0 and t.core.col % fp.align == 0
        assert t.core.row_end <= 611 and t.core.col_end <= 733
        assert t.core.height >= 16 and t.crop.height == t.core.height
