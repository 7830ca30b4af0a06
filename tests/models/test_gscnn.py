"""Gated-SCNN: flat form, exact two-pass tiling and gradients, loss terms, boundary F-score."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from seg_at_scale.errors import ConfigError, InputError
from seg_at_scale.models import GSCNN
from seg_at_scale.models.gscnn import unpack
from seg_at_scale.models.layers import check_layers, run_layers
from seg_at_scale.tasks.gscnn import (
    GSCNNLoss,
    boundary_f_counts,
    boundary_f_score,
    boundary_magnitude,
    boundary_targets,
)
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import (
    Footprint,
    empirical_halo,
    extend,
    image_pool_mean,
    make_grid,
    predict_full,
    predict_tiled,
    predict_tiled_two_pass,
    tiled_backward,
    tiled_backward_two_pass,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(**kw) -> GSCNN:
    torch.manual_seed(0)
    return GSCNN.from_preset("tiny", in_channels=4, num_classes=3, **kw)


def loud_pool(net: GSCNN) -> GSCNN:
    """Make the image-pooling branch matter, so that getting it wrong shows."""
    with torch.no_grad():
        net.aspp.pool.conv.weight.mul_(30)
    return net


# ----- flat form -------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["seg", "packed"])
@pytest.mark.parametrize("edge_band", [-1, None])
def test_pipeline_layers_equal_model(output, edge_band):
    net = tiny(output=output, edge_band=edge_band)
    layers = net.pipeline_layers()
    check_layers(layers)
    x = torch.randn(2, 4, 72, 56)
    for mode in (net.eval, net.train):  # train mode: BatchNorm sees the same batch either way
        mode()
        y = net(x)
        assert torch.equal(run_layers(layers, x), y)
    seg, edge = net.eval().forward_dual(x)
    assert y.shape[1] == (4 if output == "packed" else 3)
    if output == "packed":
        assert all(torch.equal(a, b) for a, b in zip(unpack(net(x)), (seg, edge)))


# ----- geometry and two-pass exactness ---------------------------------------------------


def test_two_pass_tiling_equals_untiled_where_one_pass_does_not():
    net = loud_pool(tiny()).double().eval()
    fp = net.footprint()
    assert (fp.align, fp.padding) == (8, "same") and fp.halo > 100
    x = torch.randn(1, 4, 357, 341, dtype=torch.float64)
    ref = predict_full(net, x)
    for kw in ({"q": 2}, {"q": (3, 2)}):
        y = predict_tiled_two_pass(net, x, **kw, out_dtype=torch.float64)
        assert (y - ref).abs().max() < 1e-12, kw
    one_pass = predict_tiled(net, x, q=2)  # each tile pools its own window
    assert (one_pass - ref).abs().max() > 1e-5
    short = Footprint(fp.context - 8, 8, "same")  # one aligned block less context
    y = predict_tiled_two_pass(net, x, q=2, fp=short, out_dtype=torch.float64)
    assert (y - ref).abs().max() > 1e-10
    grid = make_grid(357, 341, fp, q=2)
    whole = net.backbone(extend(x, fp))[-1].mean(dim=(2, 3), keepdim=True)
    assert torch.allclose(image_pool_mean(net, x, grid), whole, rtol=0, atol=1e-12)


def test_two_pass_tiling_float32_and_eval_batchnorm():
    net = loud_pool(tiny()).eval()
    x = torch.randn(1, 4, 301, 277)
    ref = predict_full(net, x)
    assert (predict_tiled_two_pass(net, x, q=2) - ref).abs().max() < 1e-4


def test_two_pass_gradient_equals_whole_image_gradient():
    net = loud_pool(tiny(norm="none")).double()
    x = torch.randn(1, 4, 341, 333, dtype=torch.float64)
    target = torch.randint(0, 3, (1, 341, 333))
    target[:, :40] = 255
    loss = CrossEntropy(3)
    s, w = loss(net(extend(x, net.footprint()))[..., :341, :333], target)
    (s / w).backward()
    ref = [p.grad.clone() for p in net.parameters()]

    def rel_err(backward) -> tuple[float, float]:
        net.zero_grad()
        value = float(backward(net, x, target, loss, q=2))
        return value, max(float((p.grad - r).abs().max() / r.abs().max().clamp_min(1e-30))
                          for p, r in zip(net.parameters(), ref))

    value, err = rel_err(tiled_backward_two_pass)
    assert abs(value - float(s.detach() / w)) < 1e-6 and err < 1e-9
    assert rel_err(tiled_backward)[1] > 1e-4  # one pass: each tile pools its own window


@pytest.mark.slow
def test_twin_halo_equals_the_full_models_probe():
    net = tiny()
    with net.fixed_image_pool(torch.zeros(1, net.pooled_width(), 1, 1, dtype=torch.float64)):
        assert empirical_halo(net, align=8) == net.footprint().halo


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="model=gscnn_<"):
        GSCNN(in_channels=4, num_classes=3, levels=4)
    with pytest.raises(ConfigError, match="model.norm='group'"):
        GSCNN(norm="group")
    with pytest.raises(ConfigError, match="model.edge_band=5"):
        GSCNN(in_channels=4, edge_band=5)
    with pytest.raises(ConfigError, match="unknown; use one of"):
        GSCNN.from_preset("huge")
    with pytest.raises(ValueError, match="multiples of 8"):
        tiny()(torch.zeros(1, 4, 60, 64))


# ----- loss terms on hand-made tensors ---------------------------------------------------


def test_boundary_targets_by_hand():
    t = torch.tensor([[[0, 0, 1, 1],
                       [0, 0, 1, 1],
                       [255, 2, 2, 2]]])
    want = torch.tensor([[[0, 1, 1, 0],
                          [1, 1, 1, 1],
                          [0, 1, 1, 1]]], dtype=torch.float32)
    assert torch.equal(boundary_targets(t, radius=1), want)
    wide = boundary_targets(torch.tensor([[[0, 0, 0, 0, 1]]]), radius=2)
    assert wide.tolist() == [[[0, 0, 1, 1, 1]]]


def test_boundary_magnitude_formula():
    m = torch.rand(2, 3, 5, 7, dtype=torch.float64)
    got = boundary_magnitude(m)
    ref = torch.zeros(2, 5, 7, dtype=torch.float64)
    for b in range(2):
        for i in range(5):
            for j in range(7):
                s = 0.0
                for k in range(3):
                    dx = m[b, k, i, j + 1] - m[b, k, i, j] if j < 6 else 0.0
                    dy = m[b, k, i + 1, j] - m[b, k, i, j] if i < 4 else 0.0
                    s += float(dx) ** 2 + float(dy) ** 2
                ref[b, i, j] = math.sqrt(s + 1e-12) / math.sqrt(2)
    assert torch.allclose(got, ref, atol=1e-12)
    step = F.one_hot(torch.tensor([[[0, 0, 1]]]), 2).permute(0, 3, 1, 2).double()
    assert torch.allclose(boundary_magnitude(step), torch.tensor([[[0.0, 1.0, 0.0]]],
                                                                  dtype=torch.float64), atol=1e-5)


def test_loss_terms_match_their_formulas():
    torch.manual_seed(1)
    seg = torch.randn(1, 3, 3, 4, dtype=torch.float64)
    edge = torch.randn(1, 1, 3, 4, dtype=torch.float64) * 3
    t = torch.tensor([[[0, 0, 1, 1], [0, 0, 1, 1], [255, 2, 2, 2]]])
    loss = GSCNNLoss(3, threshold=0.8, tau=0.5)
    terms = loss.terms(seg, edge, t)
    y = boundary_targets(t)[0]
    valid = [(i, j) for i in range(3) for j in range(4) if t[0, i, j] != 255]
    n = len(valid)
    beta = 1 - sum(float(y[i, j]) for i, j in valid) / n
    bce = 0.0
    ce, att, picked = 0.0, 0.0, 0
    for i, j in valid:
        z, lab = float(edge[0, 0, i, j]), int(t[0, i, j])
        p = 1 / (1 + math.exp(-z))
        bce += -beta * y[i, j].item() * math.log(p) - (1 - beta) * (1 - y[i, j].item()) * \
            math.log(1 - p)
        logits = seg[0, :, i, j].tolist()
        nll = math.log(sum(math.exp(v) for v in logits)) - logits[lab]
        ce += nll
        if p > 0.8:
            att, picked = att + nll, picked + 1
    assert terms["seg"][0].item() == pytest.approx(ce) and terms["seg"][1].item() == n
    assert terms["edge"][0].item() == pytest.approx(bce)
    assert terms["att"][0].item() == pytest.approx(att) and picked > 0
    assert terms["att"][1].item() == picked
    onehot = F.one_hot(t.clamp(0, 2), 3).permute(0, 3, 1, 2).double() * (t != 255)[:, None]
    zeta = boundary_magnitude(torch.softmax(seg / 0.5, 1)) - boundary_magnitude(onehot)
    assert terms["dual"][0].item() == pytest.approx(sum(abs(zeta[0, i, j].item())
                                                        for i, j in valid))
    total = ce / n + 20 * bce / n + sum(abs(zeta[0, i, j].item()) for i, j in valid) / n + \
        att / picked
    assert loss(seg, edge, t).item() == pytest.approx(total)


def test_tile_shares_add_up_to_the_whole_image_ce():
    seg = torch.randn(1, 3, 6, 10, dtype=torch.float64)
    edge = torch.zeros(1, 1, 6, 10, dtype=torch.float64)
    t = torch.randint(0, 3, (1, 6, 10))
    loss = GSCNNLoss(3, edge_weight=0.0, dual_weight=0.0, att_weight=0.0)
    norm = torch.tensor(60.0, dtype=torch.float64)
    halves = [loss.combine(loss.terms(seg[..., c], edge[..., c], t[..., c]), norm)
              for c in (slice(0, 3), slice(3, 10))]
    assert (halves[0] + halves[1]).item() == pytest.approx(F.cross_entropy(seg, t).item())


def test_bad_loss_config_is_refused():
    with pytest.raises(ConfigError, match="threshold=1.5"):
        GSCNNLoss(3, threshold=1.5)


# ----- boundary F-score ------------------------------------------------------------------


def _reference_counts(pred: np.ndarray, gt: np.ndarray, k_classes: int, tol: int) -> np.ndarray:
    """Brute force: boundary pixels by their 8-neighbours, distances point to point."""
    h, w = gt.shape
    ignore = gt == 255

    def boundary(lab: np.ndarray, k: int) -> list[tuple[int, int]]:
        pts = []
        for i in range(h):
            for j in range(w):
                if lab[i, j] != k or ignore[i, j]:
                    continue
                nbs = [(min(max(i + a, 0), h - 1), min(max(j + b, 0), w - 1))
                       for a in (-1, 0, 1) for b in (-1, 0, 1)]
                if any(lab[p] != k and not ignore[p] for p in nbs):
                    pts.append((i, j))
        return pts

    def hits(a: list, b: list) -> int:
        return sum(any((p[0] - q[0]) ** 2 + (p[1] - q[1]) ** 2 <= tol * tol for q in b)
                   for p in a)

    out = np.zeros((k_classes, 4))
    for k in range(k_classes):
        bp, bg = boundary(pred, k), boundary(gt, k)
        out[k] = [hits(bp, bg), len(bp), hits(bg, bp), len(bg)]
    return out


def test_boundary_f_counts_equal_brute_force():
    rng = np.random.default_rng(0)
    gt = np.kron(rng.integers(0, 3, (4, 5)), np.ones((4, 4), np.int64))[:15, :17]
    pred = np.roll(gt, 1, axis=1)
    pred[rng.random(pred.shape) < 0.05] = 2
    gt[:2, :3] = 255
    got = boundary_f_counts(torch.from_numpy(pred)[None], torch.from_numpy(gt)[None], 3, 2)
    np.testing.assert_array_equal(got.numpy(), _reference_counts(pred, gt, 3, 2))


def test_boundary_f_score_shift_and_tolerance():
    gt = torch.zeros(1, 20, 20, dtype=torch.long)
    gt[:, 5:15, 5:15] = 1
    pred = torch.roll(gt, 2, dims=2)
    f_tight, _ = boundary_f_score(boundary_f_counts(pred, gt, 2, tolerance=0))
    f_loose, mean = boundary_f_score(boundary_f_counts(pred, gt, 2, tolerance=2))
    assert 0 < f_tight[1] < 1 and f_loose[1] == 1.0 and mean == 1.0
    counts = torch.tensor([[3.0, 4.0, 2.0, 5.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    f, mean = boundary_f_score(counts)
    p, r = 3 / 4, 2 / 5
    assert f[0].item() == pytest.approx(2 * p * r / (p + r)) and torch.isnan(f[1])
    assert mean.item() == pytest.approx(f[0].item())


def test_docstring_example():
    import doctest

    import seg_at_scale.models.gscnn as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_fairscale_pipe_two_stages_equals_model_and_its_gradient():
    from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe

    net = tiny(output="packed", norm="none").double()
    x = torch.randn(3, 4, 64, 48, dtype=torch.float64)  # 3 samples in 2 micro-batches
    ref = net(x)
    ref.pow(2).sum().backward()
    g_ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    n = len(net.pipeline_layers())
    pipe = build_pipe(net, PipelineConfig([n // 2, n - n // 2], ["cpu", "cpu"], chunks=2))
    y = pipe(x)
    assert (y - ref).abs().max() <= 1e-12
    y.pow(2).sum().backward()
    for p, g in zip(net.parameters(), g_ref):  # the backbone's stashed features get theirs
        assert p.grad is not None and (p.grad - g).abs().max() <= 1e-9 * g.abs().max()


def test_streaming_raster_prediction_takes_the_two_pass_route(tmp_path):
    """predict_raster (seg-predict, the CLI's whole-image prediction) pools over the whole
    raster in a first pass: its labels equal the untiled network's; one pass would not."""
    from seg_at_scale.io import read_raster, write_raster
    from seg_at_scale.prediction import predict_raster
    from seg_at_scale.prediction.options import PredictOptions

    net = tiny().eval()
    with torch.no_grad():
        net.aspp.pool.conv.weight.mul_(1000)  # labels that depend on the pooled mean
    noise = np.random.default_rng(3).integers(0, 256, (4, 357, 341)).astype(np.float32)
    raw = (noise * np.linspace(0.05, 1, 341, dtype=np.float32)).astype(np.uint8)  # tiles differ
    x = torch.from_numpy(raw.astype(np.float32) / 255)[None]
    with torch.no_grad():  # split the pixels between two classes at the median margin
        ref = predict_full(net, x)[0]
        net.decoder.classify.bias[0] += (ref[1] - ref[0]).median()
        ref = predict_full(net, x)[0]
    write_raster(tmp_path / "scene.tif", raw, tile=(64, 64))
    stats = predict_raster(net, tmp_path / "scene.tif", tmp_path / "labels.tif",
                           PredictOptions(q=2, progress=False))
    got = torch.from_numpy(read_raster(tmp_path / "labels.tif")[0].astype(np.int64))
    top2 = ref.topk(2, dim=0).values
    clear = (top2[0] - top2[1]) > 1e-4  # fp32 summation order may flip near-ties only
    assert clear.float().mean() > 0.3
    assert torch.equal(got[clear], ref.argmax(0)[clear]) and stats.statistics_s > 0
    one_pass = predict_tiled(net, x, q=2)[0].argmax(0)  # each tile pools its own window
    assert (one_pass[clear] != ref.argmax(0)[clear]).sum() > 1000


# ----- the regular stream from a timm backbone ---------------------------------------------


def timm_backbone_net(tmp_path, **kw) -> tuple[GSCNN, dict[str, torch.Tensor]]:
    """Tiny Gated-SCNN on timm's test_resnet (output stride 8), weights from a timm file."""
    import timm

    torch.manual_seed(4)
    state = {k: v.uniform_(0.5, 2) if k.endswith("running_var") else
             v.normal_(0, 0.2) if v.is_floating_point() else v
             for k, v in timm.create_model("test_resnet").state_dict().items()}
    torch.save(state, tmp_path / "test_resnet.pth")
    net = GSCNN.from_preset("tiny", in_channels=4, num_classes=3, backbone="test_resnet",
                            backbone_weights=str(tmp_path / "test_resnet.pth"), **kw)
    return loud_pool(net), state


def test_timm_backbone_loads_its_weights_and_feeds_the_streams(tmp_path):
    net, state = timm_backbone_net(tmp_path, band_map=[2, 1, 0])
    body = net.regular.body.state_dict()
    assert torch.equal(body["conv1.0.weight"], state["conv1.0.weight"][:, [2, 1, 0]])
    assert torch.equal(body["layer3.0.conv1.weight"], state["layer3.0.conv1.weight"])
    assert "2 unexpected (e.g. fc.weight, fc.bias)" in net.regular.report
    seg, edge = net.eval().forward_dual(torch.randn(1, 4, 64, 48))
    assert seg.shape == (1, 3, 64, 48) and edge.shape == (1, 1, 64, 48)
    assert net.pooled_width() == net.regular.channels[4]
    with pytest.raises(ConfigError, match="has no flat layer form"):
        net.pipeline_layers()
    with pytest.raises(ConfigError, match="need model.backbone"):
        GSCNN(4, 3, backbone_weights="x.pth")
    import timm  # another network's file: named by the user's name, not smp's tu-test_resnet

    torch.save(timm.create_model("resnet18").state_dict(), tmp_path / "r18.pth")
    with pytest.raises(InputError, match=r"model.backbone_weights='.*r18.pth' does not fit "
                       r"backbone test_resnet: .*; give weights of test_resnet"):
        GSCNN.from_preset("tiny", in_channels=4, num_classes=3, backbone="test_resnet",
                          backbone_weights=str(tmp_path / "r18.pth"))


def test_timm_backbone_two_pass_tiling_and_gradient_are_exact(tmp_path):
    net, _ = timm_backbone_net(tmp_path)
    net = net.double().eval()  # frozen BatchNorm: the pretrained statistics
    fp = net.footprint()
    assert fp.align == 8 and fp.halo > 50
    x = torch.randn(1, 4, 269, 251, dtype=torch.float64)
    ref = predict_full(net, x)
    tiled = predict_tiled_two_pass(net, x, q=2, out_dtype=torch.float64)
    assert (tiled - ref).abs().max() < 1e-10 * ref.abs().max()
    target = torch.randint(0, 3, (1, 269, 251))
    loss = CrossEntropy(3)
    s, w = loss(net(extend(x, fp))[..., :269, :251], target)
    (s / w).backward()
    whole = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    tiled_backward_two_pass(net, x, target, loss, q=2)
    assert max(float((p.grad - g).abs().max()) for p, g in zip(net.parameters(), whole)) \
        < 1e-9 * max(float(g.abs().max()) for g in whole)


@pytest.mark.parametrize("backbone", [None, "test_resnet"])
@pytest.mark.parametrize("granularity", ["level", "block"])
def test_training_under_a_memory_mode_checkpoints_and_equals_plain(granularity, backbone):
    """The task's two-output forward runs through the memory mode (before, it reached the
    unwrapped model: memory=checkpoint changed nothing for Gated-SCNN); on a timm backbone,
    which has no flat form, by stage or block (before: refused)."""
    import copy

    from helpers.memory import saved_bytes

    from seg_at_scale.memory import MemoryConfig, apply_memory_mode
    from seg_at_scale.tasks.gscnn import GSCNNTask

    net = tiny(backbone=backbone)
    g = torch.Generator().manual_seed(2)
    batch = {"image": torch.randn(1, 4, 64, 80, generator=g),
             "target": torch.randint(0, 3, (1, 64, 80), generator=g),
             "norm": torch.tensor([64.0 * 80])}
    def step(task: GSCNNTask) -> tuple[int, dict[str, torch.Tensor]]:
        loss: list[torch.Tensor] = []
        saved = saved_bytes(lambda: loss.append(task.tile_loss(batch)))
        loss[0].backward()
        return saved, {n: p.grad for n, p in task.named_parameters() if p.grad is not None}

    plain = copy.deepcopy(net)
    plain_bytes, ref = step(GSCNNTask(plain, 3, channels_last=False,
                                      gradient_reduction="sum"))
    cfg = MemoryConfig("checkpoint", granularity)
    ck_bytes, got = step(GSCNNTask(apply_memory_mode(net, cfg), 3, channels_last=False,
                                     gradient_reduction="sum"))
    assert ck_bytes != plain_bytes  # the mode ran (before: the plain model, byte for byte)
    if granularity == "block":  # per level, the stride-8 half of the network is one segment
        assert ck_bytes < 0.6 * plain_bytes, (ck_bytes, plain_bytes)
    assert got.keys() == ref.keys() and len(got) > 10
    for name, grad in got.items():
        assert torch.allclose(grad, ref[name], atol=1e-6), name
    assert net.output == "seg"  # the packed output was for the call only
    for name, b in net.state_dict().items():  # train-mode BatchNorm: one update, not two
        assert torch.equal(b, plain.state_dict()[name]), name


def test_a_packed_network_predicts_its_classes_alone_and_is_restored():
    """After fit a Gated-SCNN trained packed (pipelines) predicts the test scenes with
    ``output=seg`` for the while (seg-train's predict_after_fit), then trains on packed."""
    from seg_at_scale.models.registry import for_prediction, predicting

    net = GSCNN.from_preset("tiny", in_channels=4, num_classes=3, output="packed").eval()
    node = {"_target_": "seg_at_scale.models.GSCNN", "output": "packed", "num_classes": 3}
    x = torch.randn(1, 4, 64, 64)
    with torch.no_grad():
        packed = net(x)
        with predicting(net, node) as same:
            assert same is net and net(x).shape[1] == 3
            assert torch.equal(net(x), packed[:, :3])
        assert net(x).shape[1] == 4 and net.output == "packed"
    assert for_prediction({**node, "backbone_weights": "w.pth"}) == {
        **node, "output": "seg", "backbone_weights": None}


def test_backbone_weights_normalisation_is_the_models_per_band(tmp_path):
    """Before: Gated-SCNN dropped the weights' mean/std, so finetune.normalization=weights
    did nothing for it (silently, unlike smp)."""
    import json

    timm_backbone_net(tmp_path)  # writes test_resnet.pth
    (tmp_path / "test_resnet.pth.json").write_text(json.dumps(
        {"mean": [0.1, 0.2, 0.3], "std": [1.0, 2.0, 3.0]}))
    net = GSCNN.from_preset("tiny", in_channels=4, num_classes=3, backbone="test_resnet",
                            backbone_weights=str(tmp_path / "test_resnet.pth"),
                            band_map=[2, 1, 0])
    # bands 0..2 read by the backbone (mapped to channels 2, 1, 0); band 3 is the Canny band
    assert net.input_normalization() == {"mean": [0.3, 0.2, 0.1, None],
                                         "std": [3.0, 2.0, 1.0, None], "scale": None}
    first = GSCNN.from_preset("tiny", in_channels=4, num_classes=3, backbone="test_resnet",
                              backbone_weights=str(tmp_path / "test_resnet.pth"), edge_band=0)
    assert first.input_normalization() == {"mean": [None, 0.1, 0.2, 0.3],
                                           "std": [None, 1.0, 2.0, 3.0], "scale": None}
    assert GSCNN.from_preset("tiny", in_channels=4, num_classes=3).input_normalization() is None


@pytest.mark.parametrize("task, model, keys", [
    ("gscnn", "gscnn_tiny", {"freeze_bn": "all", "freeze_encoder_epochs": 2,
                             "encoder_lr_scale": 0.1}),
    ("cosmic", "uresnet_cosmic", {"freeze_bn": "all"}),  # no encoder: BatchNorm alone
])
def test_the_finetune_group_reaches_every_task(tmp_path, task, model, keys):
    """Before: conf/task/gscnn.yaml and cosmic.yaml passed no finetune.* key, so
    experiment=finetune with Gated-SCNN trained every BatchNorm and the encoder from the
    first step, though run_config.yaml said freeze_bn: all, freeze_encoder_epochs: 2."""
    from helpers.smp import CONF
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from seg_at_scale.models.registry import build_model

    extra = ["data=cosmic"] if task == "cosmic" else []
    if task == "gscnn":
        timm_backbone_net(tmp_path)  # writes test_resnet.pth
        extra = ["model.backbone=test_resnet",
                 f"model.backbone_weights={tmp_path / 'test_resnet.pth'}"]
    with initialize_config_dir(CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"task={task}", f"model={model}",
                                          *(f"finetune.{k}={v}" for k, v in keys.items()),
                                          *extra])
    from seg_at_scale.config_check import resolved

    got = instantiate(cfg.task, model=build_model(resolved(cfg.model), where="the test"))
    assert {k: getattr(got, k) for k in keys} == keys


def test_a_band_map_is_per_band_the_backbone_reads_and_says_so(tmp_path):
    """Before: "has 4 entries for 3 input bands" for a 4-band model, with no word of the
    Canny band the backbone does not read."""
    timm_backbone_net(tmp_path)  # writes test_resnet.pth
    with pytest.raises(ConfigError) as err:
        GSCNN.from_preset("tiny", in_channels=4, num_classes=3, backbone="test_resnet",
                          backbone_weights=str(tmp_path / "test_resnet.pth"),
                          band_map=[2, 1, 0, None])
    assert str(err.value) == (
        "model.band_map=[2, 1, 0, None] has 4 entries, and the backbone reads 3 bands: the 4 "
        "input bands less the Canny band (model.edge_band=-1); give one pretrained channel "
        "(or null) per band it reads")
