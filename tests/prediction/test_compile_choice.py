"""``compile``: a compiled network is used per input shape only where its output equals the
eager network's bit for bit, so a compiled prediction writes the eager prediction's bytes;
a compile that differs or fails leaves the shape eager; ``auto`` compiles where the
measured saving pays for the compile."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.prediction import make_image

from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.errors import ConfigError
from seg_at_scale.io import read_raster
from seg_at_scale.models import UNet
from seg_at_scale.prediction import PredictOptions, compile_choice, predict_raster
from seg_at_scale.tiling import predict_full

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: what users normalise with: a per-band mean and std after scaling to [0, 1]
NORM = Normalizer(scale=1 / 255, mean=(0.45, 0.5, 0.4, 0.55), std=(0.22, 0.25, 0.2, 0.3))
OPTS = {"q": 3, "preview": False, "stac": False, "progress": False, "layout": "channels_last"}
QUAD = {**OPTS, "q": 2}
#: a strip of 9 tiles: 7 of one input shape (96x120), the last two of their own
STRIP = {**OPTS, "q": None, "tile_size": 120}


def unet() -> UNet:
    torch.manual_seed(0)
    return UNet(4, 5, levels=3, base_width=4, padding="same").eval()


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """The user's cache in tmp_path; its ``compile.json`` entries as a list."""
    monkeypatch.setenv("SEG_AT_SCALE_CACHE", str(tmp_path / "cache"))
    compile_choice.reset()  # as in a new process

    def entries() -> list[dict]:
        path = tmp_path / "cache" / compile_choice.CACHE_NAME
        return list(json.loads(path.read_text()).values()) if path.exists() else []

    return entries


def spy(monkeypatch, make=None):
    """Count the compiles and the compiled network's calls; ``make(model)`` the compiled."""
    counts = {"compiles": 0, "calls": 0}
    real = compile_choice.compiler

    def compiler(model):
        counts["compiles"] += 1
        fn = (make or real)(model)

        def call(x):
            counts["calls"] += 1
            return fn(x)

        return call

    monkeypatch.setattr(compile_choice, "compiler", compiler)
    return counts


def labels(path):
    return read_raster(path)[0]


def eager_then_compiled(tmp_path, net, image, opts, caplog):
    """The labels of ``compile=false`` and ``compile=true`` (its warnings in ``caplog``)."""
    predict_raster(net, image, tmp_path / "eager.tif", PredictOptions(compile=False, **opts),
                   normalizer=NORM)
    with caplog.at_level(logging.WARNING, logger=compile_choice.__name__):
        predict_raster(net, image, tmp_path / "c.tif", PredictOptions(compile=True, **opts),
                       normalizer=NORM)
    return labels(tmp_path / "eager.tif"), labels(tmp_path / "c.tif")


# make test-all: inductor's first compile on a machine (its on-disk cache empty, as in CI)
# is 20-40 s of C++ compiling here. What the bytes rest on, a compile used only where its
# output equals the eager one's, is the stand-in compilers' tests below.
@pytest.mark.slow
def test_the_compiled_prediction_writes_the_eager_bytes(tmp_path, cache, monkeypatch):
    """torch.compile itself, fp32 channels-last, a 93x613 strip of 9 tiles."""
    net, image = unet(), make_image(tmp_path / "scene.tif", height=93, width=613)
    counts = spy(monkeypatch)
    predict_raster(net, image, tmp_path / "eager.tif", PredictOptions(compile=False, **STRIP),
                   normalizer=NORM)
    assert counts == {"compiles": 0, "calls": 0}
    monkeypatch.setattr(compile_choice, "TRIAL_S", 1e-9)  # as if the scene were huge
    predict_raster(net, image, tmp_path / "compiled.tif", PredictOptions(compile="auto", **STRIP),
                   normalizer=NORM)
    # the shape of 7 tiles: its first tile eagerly and compiled (compared), the next four
    # compiled, eager, compiled, eager (timed), the last two compiled (or eager, if that
    # was faster); the last two tiles, one forward of each shape, eagerly: a compile
    # cannot pay there
    assert counts["compiles"] == 1 and counts["calls"] in (3, 5)
    [entry] = cache()
    assert json.loads(entry["shape"])[0] == [1, 4, 96, 120]
    assert entry["equal"] is True and entry["compile_s"] > 0 and entry["compiled_s"] > 0
    np.testing.assert_array_equal(labels(tmp_path / "compiled.tif"), labels(tmp_path / "eager.tif"))
    x = torch.from_numpy(NORM(read_raster(image)))[None]
    with torch.inference_mode():  # and both are the untiled forward's
        whole = predict_full(net, x).argmax(1)[0].numpy().astype(np.uint8)
    np.testing.assert_array_equal(labels(tmp_path / "compiled.tif"), whole)


def _perturbed(model):
    return lambda x: torch.nextafter(model(x), torch.tensor(math.inf))


def test_a_compile_that_changes_one_bit_is_not_used(tmp_path, cache, monkeypatch, caplog):
    net, image = unet(), make_image(tmp_path / "scene.tif", height=133, width=170)
    counts = spy(monkeypatch, _perturbed)
    eager, compiled = eager_then_compiled(tmp_path, net, image, QUAD, caplog)
    # each shape of the 2x2 tiles compared once, then never used
    shapes = len(cache())
    assert shapes >= 2 and counts == {"compiles": 1, "calls": shapes}
    assert "differs from the eager network's; this shape runs eagerly" in caplog.text
    assert [e["equal"] for e in cache()] == [False] * shapes
    np.testing.assert_array_equal(compiled, eager)
    # auto, however much work is left, does not try that shape again (a new process too)
    monkeypatch.setattr(compile_choice, "TRIAL_S", 0.0)
    compile_choice._NETWORKS.clear()
    predict_raster(net, image, tmp_path / "a.tif", PredictOptions(compile="auto", **QUAD),
                   normalizer=NORM)
    assert counts["compiles"] == 1 and counts["calls"] == shapes


def test_a_compile_that_fails_leaves_the_network_eager(tmp_path, cache, monkeypatch, caplog):
    def broken(model):
        def fn(x):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return fn

    net, image = unet(), make_image(tmp_path / "scene.tif", height=133, width=170)
    counts = spy(monkeypatch, broken)
    eager, compiled = eager_then_compiled(tmp_path, net, image, OPTS, caplog)
    assert counts == {"compiles": 1, "calls": 1}  # not tried again on the other shapes
    assert "compile=True: compiling the network failed on input 1x4x" in caplog.text
    assert "No working C++ compiler found" in caplog.text and "compile=false" in caplog.text
    assert "No working C++ compiler" in cache()[0]["error"]
    np.testing.assert_array_equal(compiled, eager)
    # nor in the next prediction of this network in this process
    predict_raster(net, image, tmp_path / "again.tif", PredictOptions(compile=True, **OPTS),
                   normalizer=NORM)
    assert counts == {"compiles": 1, "calls": 1}


def _same(model):
    return model


def test_auto_tries_a_shape_only_where_the_work_left_can_pay(tmp_path, cache, monkeypatch):
    net, image = unet(), make_image(tmp_path / "scene.tif", height=93, width=613)
    counts = spy(monkeypatch, _same)
    predict_raster(net, image, tmp_path / "small.tif", PredictOptions(**STRIP), normalizer=NORM)
    assert counts["compiles"] == 0 and cache() == []  # 9 tiny tiles: far below TRIAL_S
    monkeypatch.setattr(compile_choice, "TRIAL_S", 0.0)  # as if the scene were huge
    predict_raster(net, image, tmp_path / "big.tif", PredictOptions(**STRIP), normalizer=NORM)
    assert counts["compiles"] == 1  # the 7 tiles' shape; not the shapes of one forward
    [entry] = cache()
    assert entry["equal"] is True and entry["compiled_s"] > 0 and entry["eager_s"] > 0
    np.testing.assert_array_equal(labels(tmp_path / "big.tif"), labels(tmp_path / "small.tif"))


@pytest.mark.parametrize(("seen", "forwards", "compiled"), [
    ({"equal": True, "eager_s": 1.0, "compiled_s": 0.5, "compile_s": 10.0}, 30, True),
    ({"equal": True, "eager_s": 1.0, "compiled_s": 0.5, "compile_s": 10.0}, 10, False),
    ({"equal": True, "eager_s": 1.0, "compiled_s": 1.2, "compile_s": 0.1}, 10**6, False),
    ({"equal": False, "eager_s": 1.0, "compile_s": 0.1}, 10**6, False),
    ({"error": "BackendCompilerFailed", "eager_s": 1.0}, 10**6, False),
])
def test_auto_weighs_the_saving_measured_before_against_the_compile(cache, monkeypatch, seen,
                                                                     forwards, compiled):
    counts = spy(monkeypatch, _same)
    net, x = unet(), torch.randn(1, 4, 72, 88)
    checked = compile_choice.CheckedCompile(net, "auto")
    path = compile_choice.cache_path(compile_choice.CACHE_NAME)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({checked.entry_key(x): {"shape": "x", **seen}}))
    checked.expect(Counter({(1, 72, 88): forwards}))
    with torch.inference_mode():
        y = checked(x)
        torch.testing.assert_close(y, net(x), rtol=0, atol=0)
    assert counts["compiles"] == int(compiled)


def test_compile_is_refused_unless_true_false_or_auto():
    with pytest.raises(ConfigError, match=r"compile='maybe' is not .*; give compile="):
        PredictOptions.from_mapping({"compile": "maybe"})
    assert PredictOptions.from_mapping({"compile": True}).compile is True


def test_an_archive_weighs_its_scenes_together_and_writes_the_eager_bytes(tmp_path, cache,
                                                                          monkeypatch):
    """Two 93x613 strips: 7 forwards of one shape each. A clock where a forward takes one
    second (compiled half, compiling 20); a trial where 10 are left: no scene alone has
    them, the archive has."""
    from helpers.prediction import make_model, make_run

    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction.archive import archive_scenes, predict_archive

    class Clock:  # a forward takes a second, compiled half a second, compiling 20 s
        t, compiled = 0.0, 0

        def now(self, x):
            self.t += 1.0
            return self.t

        def compiled_forward(self, model, x):
            self.t += 20.0 if self.compiled == 0 else -0.5
            self.compiled += 1
            return model(x)

    clock = Clock()
    monkeypatch.setattr(compile_choice, "_now", clock.now)
    monkeypatch.setattr(compile_choice, "TRIAL_S", 10.0)
    counts = spy(monkeypatch, lambda m: lambda x: clock.compiled_forward(m, x))
    trained = load_trained(make_run(tmp_path / "run", make_model(width=4)), ckpt="last")
    (tmp_path / "in").mkdir()
    for i in range(2):
        make_image(tmp_path / "in" / f"s{i}.tif", height=93, width=613, seed=i)
    opts = {k: v for k, v in STRIP.items() if k != "layout"}
    outs = {}
    for mode in (False, "auto"):
        scenes = archive_scenes(str(tmp_path / "in" / "*.tif"), tmp_path / str(mode))
        records = predict_archive(trained, scenes, PredictOptions(compile=mode, **opts))
        assert [r.status for r in records] == ["done", "done"]
        outs[mode] = [labels(s.output) for s in scenes]
    # one compile: of the first scene's 7 tiles of that shape, the first compared, two of
    # the next four timed compiled (alternating with eager), the last two compiled; the
    # second scene's 7 compiled; the other shapes (one forward each) eager
    assert counts["compiles"] == 1 and counts["calls"] == 5 + 7
    for eager, compiled in zip(outs[False], outs["auto"], strict=True):
        np.testing.assert_array_equal(compiled, eager)
    [entry] = cache()
    assert entry["compile_s"] == 20.0 and entry["compiled_s"] == 0.5 and entry["eager_s"] == 1
    for i in range(2):  # one scene alone: 6 forwards left save 3 s, not the compile's 20 s
        compile_choice._NETWORKS.clear()
        predict_raster(trained.model, tmp_path / "in" / f"s{i}.tif", tmp_path / f"one{i}.tif",
                       PredictOptions(compile="auto", **opts), fp=trained.footprint,
                       normalizer=trained.normalizer)
    assert counts["compiles"] == 1


def test_no_more_shapes_are_tried_than_torch_keeps_compiled(tmp_path, cache, monkeypatch):
    """Past its recompile limit torch runs a forward eagerly unasked: no trial would be real."""
    net, image = unet(), make_image(tmp_path / "scene.tif", height=133, width=170)
    counts = spy(monkeypatch, _same)
    with torch._dynamo.config.patch(recompile_limit=2):  # its own patch: monkeypatch breaks it
        predict_raster(net, image, tmp_path / "c.tif", PredictOptions(compile=True, **OPTS),
                       normalizer=NORM)
    assert counts["calls"] == 2 and len(cache()) == 2  # 2 of the 9 shapes (3x3 tiles)
