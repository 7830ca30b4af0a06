"""The CUDA paths, proven on a GPU: `make test-gpu` (``pytest -m gpu``).

Every test takes a ``device`` and asserts on it what the CPU suite asserts on the CPU:
exact tiled prediction and gradients, memory modes equal to ``none``, fairscale Pipe with
CUDA streams, sample parallelism over a process group, ``tiling.tile_size=auto`` by
``torch.cuda.max_memory_allocated``, and the CLI (train, checkpoint, resume, predict).
The ``cuda`` variants carry the ``gpu`` marker and skip, with the reason, where CUDA is
absent; the ``cpu`` variants run the same bodies in the normal suite on tiny sizes, so the
harness itself cannot rot (the CLI body on CPU is ``slow``: ``test_cli.py`` covers it).
fp32 comparisons run with TF32 off (restored afterwards): TF32 rounds the inputs of every
matrix product and convolution to 10 mantissa bits, which is not what "exact" means here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.cli import CONF, TINY, run_train
from hydra import compose, initialize_config_dir
from torch import nn

from seg_at_scale.cli.predict import run_prediction
from seg_at_scale.data.normalize import Normalizer
from seg_at_scale.io import read_raster
from seg_at_scale.memory import MemoryConfig, StepSpec, apply_memory_mode, find_largest_tile
from seg_at_scale.memory.probe import StepMeasure, measure_step
from seg_at_scale.models import UNet
from seg_at_scale.models.trained import load_run
from seg_at_scale.parallel.launch import all_reduce_gradients, spawn
from seg_at_scale.parallel.pipe import PipelineConfig, build_pipe, close_pipe
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import (
    extend,
    footprint,
    infer,
    predict_full,
    predict_tiled,
    tiled_backward,
)
from seg_at_scale.tiling.tile_sides import legal_side

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False): run `make test-gpu` on a GPU"
ON_GPU = pytest.param("cuda", id="cuda",
                      marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)])
ON_CPU = pytest.param("cpu", id="cpu")
GPU_TESTS = {"test_tiled_prediction_equals_untiled", "test_bf16_fast_path_agrees",
             "test_tiled_gradients_equal_whole_image", "test_memory_mode_gives_none_gradients",
             "test_offload_moves_saved_tensors_to_pinned_host_memory",
             "test_host_copy_is_complete_when_it_returns",
             "test_pipe_on_one_device_equals_plain_model",
             "test_sample_parallel_gradient_equals_whole_image",
             "test_auto_tile_fits_and_the_next_size_does_not", "test_cli_train_resume_predict",
             "test_prediction_tile_auto_predicts_its_memory_and_runs_a_fitting_scene_whole",
             "test_the_file_path_queues_every_batch_without_waiting_for_the_device"}
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: shared CPU cores
MODES = [MemoryConfig("checkpoint", "level"), MemoryConfig("checkpoint", "block"),
         MemoryConfig("checkpoint", "layers", every=3),
         MemoryConfig("checkpoint", "strips", strip_rows=6),
         MemoryConfig("checkpoint", "strips", strip_rows=6, strip_cols=10),
         MemoryConfig("offload"), MemoryConfig("checkpoint_offload", "level"),
         MemoryConfig("checkpoint_offload", "block")]


@pytest.fixture(params=[ON_CPU, ON_GPU])
def device(request: pytest.FixtureRequest) -> torch.device:
    """``cpu``, or ``cuda:<current>`` (an explicit index: Pipe stages name their device)."""
    if request.param == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32: TF32 off for matmuls and cuDNN convolutions, restored afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def lively(net: nn.Module) -> nn.Module:
    """Variance-keeping random weights: the default init predicts one class everywhere."""
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return net.eval()


def unet(padding: str = "same", levels: int = 3, width: int = 4, seed: int = 0) -> UNet:
    torch.manual_seed(seed)
    return UNet(in_channels=3, num_classes=4, levels=levels, convs_per_level=2,
                base_width=width, padding=padding)


def grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in net.parameters()]


def assert_labels_equal(labels: torch.Tensor, ref: torch.Tensor) -> None:
    """``labels [B, H, W]`` equal ``ref``'s argmax wherever ``ref [B, K, H, W]`` is not a
    tie within float noise (those are >= 99.9 % of the pixels)."""
    expected = ref.argmax(1)
    assert expected.unique().numel() > 1  # a non-trivial labelling
    top2 = ref.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-5 * ref.abs().max()
    assert decided.float().mean() > 0.999
    assert torch.equal(labels[decided], expected[decided])


# ----- exact tiling ------------------------------------------------------------------------


@pytest.mark.parametrize(("padding", "shape", "q"), [("same", (184, 232), (2, 3)),
                                                      ("valid", (301, 277), 3)])
def test_tiled_prediction_equals_untiled(device, padding, shape, q):
    torch.manual_seed(1)
    net = lively(UNet(in_channels=4, num_classes=5, levels=4, convs_per_level=2, base_width=4,
                      padding=padding)).to(device)
    x = torch.randn(2, 4, *shape, device=device)
    ref = predict_full(net, x)
    # the cores stay where the image is, as the untiled forward's logits (they came back to
    # the host, copied and waited for tile by tile, whatever the image's device)
    tiled = predict_tiled(net, x, q=q)
    assert tiled.shape == ref.shape and tiled.device == x.device
    assert (tiled - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert_labels_equal(tiled.argmax(1).cpu(), ref.cpu())
    # a scene in host memory, the network on the device: tiles go there, cores come back
    host = predict_tiled(net, x.cpu(), q=q)
    assert host.device.type == "cpu" and (host - ref.cpu()).abs().max() <= 1e-5 * ref.abs().max()
    whole = infer(net, x.cpu())  # untiled, too: the image to the network and back
    assert whole.device.type == "cpu" and (whole - ref.cpu()).abs().max() <= 1e-6 * ref.abs().max()


def test_bf16_fast_path_agrees(device):
    """bf16 autocast + channels_last: tiled labels agree with untiled bf16 on >= 99.9 % of
    pixels, and with fp32 on >= 99 % (random weights: logits close to ties)."""
    torch.manual_seed(3)
    net = lively(UNet(in_channels=2, num_classes=3, levels=3, base_width=8, padding="same"))
    net = net.to(device, memory_format=torch.channels_last)
    x = torch.randn(1, 2, 212, 156, device=device)
    fp32 = predict_full(net, x).argmax(1).cpu()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        full = predict_full(net, x).argmax(1).cpu()
    fast = predict_tiled(net, x, tile_size=96, autocast=torch.bfloat16).argmax(1)
    assert (fast == full).float().mean() >= 0.999
    assert (fast == fp32).float().mean() >= 0.99


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize(("padding", "shape"), [("valid", (301, 277)), ("same", (152, 120))])
def test_tiled_gradients_equal_whole_image(device, dtype, rtol, padding, shape):
    h, w = shape
    net = unet(padding, seed=4).to(device, dtype)
    x = torch.randn(1, 3, h, w, dtype=dtype, device=device)
    target = torch.randint(0, 4, (1, h, w), device=device)
    target[0, :17, :23] = 255  # ignored pixels
    weights = [1.0, 2.0, 0.5, 1.5]
    logits = net(extend(x, net.footprint()))[..., :h, :w]
    whole = F.cross_entropy(logits, target, ignore_index=255,
                            weight=torch.tensor(weights, dtype=dtype, device=device))
    whole.backward()
    reference = grads(net)
    net.zero_grad()
    loss = tiled_backward(net, x, target, CrossEntropy(4, weights).to(device), q=3)
    assert torch.allclose(loss.double().cpu(), whole.detach().double().cpu(), rtol=1e-5)
    for p, g in zip(net.parameters(), reference, strict=True):
        assert (p.grad - g).norm() <= rtol * g.norm()


# ----- memory modes ------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", MODES, ids=lambda c: c.label + ("-cols" if c.strip_cols == 10
                                                                 else ""))
def test_memory_mode_gives_none_gradients(device, cfg):
    """Untiled and through exact tiled training (fp32, 1e-5 of the largest gradient)."""
    net = unet().to(device)
    x = torch.randn(2, 3, 52, 76, device=device)
    target = torch.randint(0, 4, (2, 52, 76), device=device)
    loss = CrossEntropy(4).to(device)

    def run(model: nn.Module) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
        net.zero_grad(set_to_none=True)
        s, wsum = loss(model(x), target)
        (s / wsum).backward()
        untiled = grads(net)
        net.zero_grad(set_to_none=True)
        tiled_backward(model, x[:1], target[:1], loss, q=2)
        return float((s / wsum).detach()), untiled, grads(net)

    l_ref, *g_ref = run(net)
    l_mode, *g_mode = run(apply_memory_mode(net, cfg))
    assert abs(l_mode - l_ref) <= 1e-5 * abs(l_ref)
    for got, ref in zip(g_mode, g_ref, strict=True):
        for a, b in zip(got, ref, strict=True):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


def test_offload_moves_saved_tensors_to_pinned_host_memory(device, monkeypatch):
    """On CUDA every device tensor autograd saves goes to pinned host memory and the step's
    peak device memory drops; on a CPU the tensors already live in host memory: nothing moves."""
    packed: list[tuple[str, str, bool]] = []

    class Recording(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def recorded(t: torch.Tensor):
                dev, host = pack(t)
                packed.append((t.device.type, host.device.type, host.is_pinned()))
                return dev, host

            self.pack_hook = recorded

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    net = unet(levels=4, width=16).to(device)
    side = 256 if device.type == "cuda" else 64  # activations well above the weights on CUDA
    x = torch.randn(2, 3, side, side, device=device)
    peaks = {}
    for mode in ("none", "none", "offload", "checkpoint_offload"):  # first: warm-up
        peaks[mode], g = step_peak(apply_memory_mode(net, mode), x, device)
        if mode == "none":
            ref = g
        for a, b in zip(g, ref, strict=True):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    if device.type == "cpu":
        assert packed == []
        return
    # device tensors go to pinned host memory; checkpoint_offload's segment inputs are
    # already host copies (its differentiable move), which autograd keeps where they are
    moved = [p for p in packed if p[0] == "cuda"]
    assert moved and all(p == ("cuda", "cpu", True) for p in moved), set(packed)
    assert all(p[:2] == ("cpu", "cpu") for p in packed if p[0] != "cuda"), set(packed)
    # H200, side 256: offload 0.57x none (weights and workspace stay); bench_gpu's
    # offload_cost at 4096^2: 0.50x
    assert peaks["offload"] < 0.65 * peaks["none"], peaks
    assert peaks["checkpoint_offload"] < 0.8 * peaks["none"], peaks  # recomputes a level


def test_host_copy_is_complete_when_it_returns(device):
    """``checkpoint_offload`` moves segment inputs to host memory with ``_ToHost``, and
    ``save_on_cpu`` may then copy them on the CPU at once: the copy must have landed. It was
    asynchronous, and ``checkpoint_offload:block`` gradients came out wrong on an H200 in one
    run of two (the CPU memcpy read the pinned buffer before the device had written it)."""
    from seg_at_scale.memory.modes import _ToHost

    x = torch.randn(64, 1024, 1024, device=device)  # 256 MB: a copy takes milliseconds
    y = _ToHost.apply(x, device.type == "cuda")
    if device.type == "cuda":
        assert torch.cuda.current_stream(device).query()  # no copy still in flight
        assert y.device.type == "cpu" and y.is_pinned()
    else:  # already in host memory: the same storage, nothing copied
        assert y.data_ptr() == x.data_ptr()
    assert torch.equal(y, x.cpu())


def step_peak(model: nn.Module, x: torch.Tensor, device: torch.device
              ) -> tuple[int, list[torch.Tensor]]:
    """Peak device bytes above the start of a forward + backward (0 on CPU), and gradients."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    model(x).square().mean().backward()
    if device.type != "cuda":
        return 0, grads(model)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base, grads(model)


# ----- Pipe and sample parallelism ---------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 3])
def test_pipe_on_one_device_equals_plain_model(device, stages):
    """fairscale Pipe on one device (CUDA: its copy streams), 3 samples in 2 micro-batches."""
    net = unet("valid").to(device, torch.float64)
    x = torch.randn(3, 3, 108, 100, dtype=torch.float64, device=device)
    ref = net(x)
    ref.pow(2).sum().backward()
    g_ref = grads(net)
    net.zero_grad(set_to_none=True)
    n = len(net.pipeline_layers())
    balance = [n] if stages == 1 else [5, n - 12, 7]
    pipe = build_pipe(net, PipelineConfig(balance, [str(device)] * stages, chunks=2,
                                          checkpoint="except_last"))
    try:
        y = pipe(x)
        assert y.device == x.device
        assert (y - ref).abs().max() <= 1e-12 * ref.abs().max()
        y.pow(2).sum().backward()
    finally:
        close_pipe(pipe)
    for a, b in zip(grads(net), g_ref, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def _whole_image_case(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    image = torch.randn(1, 3, 181, 203, generator=g, dtype=torch.float64)
    target = torch.randint(0, 4, (1, 181, 203), generator=g)
    target[0, :20, :30] = 255
    return image.to(device), target.to(device)


def rank_gradients(rank: int, world: int, out: str, device_type: str) -> None:
    """One rank: its tiles of the image, then the all-reduced (summed) gradient."""
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)  # NCCL: one GPU per rank
    net = unet(seed=1).to(device, torch.float64)
    image, target = _whole_image_case(device)
    tiled_backward(net, image, target, CrossEntropy(4).to(device), q=3, shard=(rank, world))
    all_reduce_gradients(net.parameters(), "sum")
    if rank == 0:
        torch.save([g.cpu() for g in grads(net)], out)


@pytest.mark.parametrize("device", [ON_GPU], indirect=True)  # on the CPU: the same case is
# tests/parallel/test_parallel.py::test_two_process_gradients_equal_whole_image[sample_parallel]
def test_sample_parallel_gradient_equals_whole_image(device, tmp_path):
    """Two ranks share 9 tiles: NCCL with a GPU per rank, else gloo over CUDA tensors (NCCL
    needs one GPU per rank)."""
    nccl = device.type == "cuda" and torch.cuda.device_count() >= 2
    out = str(tmp_path / "grads.pt")
    spawn(rank_gradients, 2, out, device.type, backend="nccl" if nccl else "gloo")
    net = unet(seed=1).to(device, torch.float64)
    image, target = _whole_image_case(device)
    logits = net(extend(image, net.footprint()))[..., :181, :203]
    s, w = CrossEntropy(4).to(device)(logits, target)
    (s / w).backward()
    for a, b in zip(torch.load(out), grads(net), strict=True):
        assert (a - b.cpu()).abs().max() <= 1e-10 * b.abs().max().item()


# ----- tiling.tile_size=auto ---------------------------------------------------------------


def test_auto_tile_fits_and_the_next_size_does_not(device):
    """On CUDA the search measures ``max_memory_allocated``; the budget is the peak of a
    768 px step, so the answer lies just below. On a CPU the probes would each spawn a
    process: the same body runs on a deterministic peak ``base + c * side^2``."""
    net = unet(levels=4, width=8)
    fp = footprint(net)
    spec = StepSpec(MemoryConfig("none"))
    probe = None
    if device.type == "cpu":
        def probe(side: int) -> StepMeasure:
            return StepMeasure(side, 300 * 2**20 + 900 * side * side, 300 * 2**20, 1.0, True)
    measure = probe or (lambda side: measure_step(net, side, spec, device=device))
    budget = measure(legal_side(fp, 768)).peak_bytes
    search = find_largest_tile(net, budget, spec, device=device, rel_tol=0.0, max_probes=16,
                               measure=probe)
    limit = int(budget * 0.98)  # find_largest_tile's default margin
    assert 2 * fp.context + fp.align < search.side < 768
    assert measure(search.side).peak_bytes <= limit
    assert measure(search.side + fp.align).peak_bytes > limit


def test_prediction_tile_auto_predicts_its_memory_and_runs_a_fitting_scene_whole(device):
    """``tile_size=auto`` on the device: three small forwards predict a larger window's peak
    (CUDA's ``max_memory_allocated``, the CPU's live tensors) within 5 %; a scene whose
    window fits is one tile, and the prediction equals the untiled forward."""
    from seg_at_scale.tiling.auto_tile import tile_memory
    from seg_at_scale.tiling.staged.peak_memory import LiveMemory

    net = unet(levels=3, width=8).to(device).eval()
    fp = footprint(net)
    mem = tile_memory(net, 3, fp)
    side = legal_side(fp, 1003)
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            y = torch.zeros(1, 3, side, side, device=device)
            net(y)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            with LiveMemory() as live:
                net(torch.zeros(1, 3, side, side))
            peak = live.peak
    assert abs(mem.bytes(side) - peak) <= 0.05 * peak
    image = torch.randn(1, 3, 517, 389, device=device)
    ref = predict_full(net, image)
    assert torch.equal(infer(net, image, tile_size="auto"), ref)  # fits: untiled
    # tiled or not, the result is where the image is (auto's choice does not move it)
    for method, size in (("tiled", 192), ("blended", 192)):
        out = infer(net, image, method=method, tile_size=size)
        assert out.device == image.device and out.shape == ref.shape


# ----- the file path ----------------------------------------------------------------------


def test_the_file_path_queues_every_batch_without_waiting_for_the_device(device, tmp_path,
                                                                         monkeypatch):
    """The file path's batch loop never waits for the device: under CUDA's sync debug mode
    (an error on any wait: ``.cpu()``, ``.item()``, a copy from pageable memory) the next
    batch is queued while the last runs, and the writer's thread waits for each batch's
    copies. What it writes is the untiled forward's: labels, uint8 probabilities, and no
    data (a corner of zeros) 255, on a 263 x 190 scene of 3 bands in tiles of 64."""
    import zarr

    from seg_at_scale.io import example_geotags, write_raster
    from seg_at_scale.prediction import PredictOptions, predict_raster
    from seg_at_scale.prediction import raster as raster_mod

    rng = np.random.default_rng(5)
    img = rng.integers(1, 255, (3, 263, 190)).astype(np.uint8)
    img[:, 230:, :41] = 0  # no data (tag 0) reaching the border
    path = write_raster(tmp_path / "s.tif", img, tile=(64, 64), geotags=example_geotags(),
                        nodata=0)
    invalid = (img == 0).all(0)
    norm = Normalizer(1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    net = lively(unet(width=8)).to(device)
    if device.type == "cuda":
        batches = raster_mod.run_parts

        def watched(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield from batches(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(raster_mod, "run_parts", watched)
    stats = predict_raster(net, path, tmp_path / "m.zarr",
                           PredictOptions(tile_size=64, batch_size=3, probabilities="uint8",
                                          compile=False, layout="contiguous", progress=False),
                           normalizer=norm)
    assert stats.batches > 3 and stats.tiles_computed == stats.tiles
    group = zarr.open_group(tmp_path / "m.zarr", mode="r")
    labels = torch.from_numpy(group["labels"][:])
    probs = torch.from_numpy(group["probabilities"][:].astype(np.int16))
    x = torch.from_numpy(norm(np.where(invalid, 0, img)))[None].to(device)
    ref = predict_full(net, x).float().cpu()
    inside = torch.from_numpy(~invalid)
    assert torch.equal(labels == 255, ~inside)
    assert_labels_equal(torch.where(inside, labels, ref[0].argmax(0))[None].long(), ref)
    expected = torch.round(torch.softmax(ref[0], 0) * 255).to(torch.int16)
    assert (probs - expected)[:, inside].abs().max() <= 1
    assert int(probs[:, ~inside].abs().max()) == 0


# ----- the CLI end to end ------------------------------------------------------------------


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu", marks=pytest.mark.slow),
                                    ON_GPU], indirect=True)
def test_cli_train_resume_predict(device, tmp_path):
    """trainer=gpu: train, checkpoint, resume, then predict a raster on the device, exact
    (fp32) against the untiled model and fast (bf16) on >= 99 % of the labels."""
    fast_trainer = ["trainer.max_epochs=1", "+trainer.limit_train_batches=2",
                    "+trainer.limit_val_batches=2", "trainer.enable_progress_bar=false"]
    on = ["trainer=gpu"] if device.type == "cuda" else ["trainer=default",
                                                        "trainer.accelerator=cpu"]
    args = [*(o for o in TINY if not o.startswith("trainer=")), *on, *fast_trainer,
            "predict_after_fit=false"]
    env = {k: v for k, v in os.environ.items() if k.startswith(("CUDA", "NVIDIA", "LD_"))}
    first = run_train(tmp_path, "run", *args, timeout=300, env=env)
    assert f"used: {device.type == 'cuda'}" in first["log"]  # Lightning: "GPU available: ..."
    again = run_train(tmp_path, "run", *args, "trainer.max_epochs=2", timeout=300, env=env)
    assert "Restoring states from the checkpoint" in again["log"]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (2, 4)
    # four steps leave one class everywhere: predict with lively weights in the same format
    model = load_run(tmp_path / "run", "last").model
    lively(model)
    ckpt["state_dict"] = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save(ckpt, tmp_path / "lively.ckpt")
    image = next((tmp_path / "data").glob("*/test/scene_0_image.tif"))
    labels = {}
    for fast in ("false", "true"):
        with initialize_config_dir(CONF.replace("/conf", "/conf_predict"), version_base="1.3"):
            cfg = compose("predict", overrides=[
                f"run={tmp_path / 'run'}", f"ckpt={tmp_path / 'lively.ckpt'}", f"image={image}",
                f"output={tmp_path}/{fast}.tif", "preview=false", "tile_size=64",
                f"fast={fast}", f"device={device.type}"])
        assert run_prediction(cfg)["tiles"] > 4
        labels[fast] = torch.from_numpy(read_raster(tmp_path / f"{fast}.tif")[0].astype(np.int64))
    x = torch.from_numpy(Normalizer(1 / 255, (0.5,), (0.25,))(read_raster(image)))[None]
    ref = predict_full(model.to(device), x.to(device)).cpu()
    assert_labels_equal(labels["false"][None], ref)
    assert (labels["true"] == ref.argmax(1)[0]).float().mean() >= 0.99


# ----- the harness -------------------------------------------------------------------------


@pytest.mark.slow  # make test-slow: the GPU suite's harness, in a pytest of its own
def test_gpu_suite_collects_and_skips_cleanly():
    """`pytest -m gpu` selects exactly the cuda variants of the tests above; without CUDA
    each one skips with the reason (with CUDA, only collection is checked here)."""
    here = Path(__file__)
    cmd = [sys.executable, "-m", "pytest", str(here), "-m", "gpu", "-p", "no:cacheprovider",
           *(["--collect-only", "-q"] if HAS_CUDA else ["-v", "-rs"])]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=here.parents[1], timeout=300)
    ids = [line.split()[0] for line in out.stdout.splitlines() if "test_gpu.py::" in line]
    assert ids, out.stdout[-3000:] + out.stderr[-3000:]
    assert all("[cuda" in i for i in ids), ids
    assert {i.split("::")[1].split("[")[0] for i in ids} == GPU_TESTS
    assert out.returncode == 0, out.stdout[-3000:]
    if not HAS_CUDA:
        assert f"{len(ids)} skipped" in out.stdout and NO_CUDA in out.stdout
