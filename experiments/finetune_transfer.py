"""Does a pretrained encoder help? Pretrain on one synthetic domain, fine-tune on another.

    .venv/bin/python experiments/finetune_transfer.py            # ~15 min on 2 CPU cores
    .venv/bin/python experiments/finetune_transfer.py --quick    # a smoke run

Both domains are synthetic (``seg_at_scale.data.synthetic.SceneGenerator``, 5 classes):

* **domain A** (pretraining): 3-band R, G, B scenes, plenty of labels. An smp U-Net on
  ``tu-resnet18`` is trained there; its encoder is saved as a timm-layout ``.safetensors``
  file (``conv1.weight``, ``layer1.0...``), domain A's normalisation in its header;
* **domain B** (the task): other scenes, 4 bands in another order (NIR, R, G, B) and
  another radiometry (gain 0.8, offset +30), and only ``--labels`` labelled 128 x 128
  tiles. The same network with ``in_channels=4`` is fine-tuned from the file
  (``band_map=[null, 0, 1, 2]``: NIR starts at zero; BatchNorm frozen; the encoder
  frozen for the first epoch, then at a tenth of the learning rate) against the same
  network from scratch, with the same budget (epochs, steps, batch, optimiser).

Figure: mIoU on held-out domain-B scenes against epochs, both runs (PNG + JSON), three
seeds each.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS, add_harness_args, save
from safetensors.torch import save_file

from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.metrics import iou_from_confusion
from seg_at_scale.models.smp import SMPModel
from seg_at_scale.tasks.finetune import (
    freeze_batch_norm,
    optimizer_groups,
    set_encoder_trainable,
)
from seg_at_scale.tasks.losses import CrossEntropy
from seg_at_scale.tiling import Window

K = 5
ENCODER = "tu-resnet18"
NORM_A = {"mean": [0.45, 0.45, 0.45], "std": [0.25, 0.25, 0.25]}


def crops(seed: int, n: int, size: int, bands: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` image/mask crops of one scene (uint8 ``[n, bands, s, s]``, ``[n, s, s]``)."""
    gen = SceneGenerator(seed, 4096, 4096, bands=bands)
    rng = np.random.default_rng(seed)
    out = [gen.render(Window(int(r), int(c), size, size))
           for r, c in rng.integers(0, 4096 - size, (n, 2))]
    return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


def domain_a(n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = crops(100, n, size, 3)
    t = torch.from_numpy(x).float() / 255
    mean = torch.tensor(NORM_A["mean"]).view(1, 3, 1, 1)
    return (t - mean) / torch.tensor(NORM_A["std"]).view(1, 3, 1, 1), torch.from_numpy(y).long()


def domain_b(seed: int, n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NIR, R, G, B; gain 0.8, offset +30; normalised with domain A's statistics on R, G, B."""
    x, y = crops(seed, n, size, 4)
    x = np.clip(x[:, [3, 0, 1, 2]].astype(np.float32) * 0.8 + 30, 0, 255)
    t = torch.from_numpy(x) / 255
    mean = torch.tensor([0.5] + NORM_A["mean"]).view(1, 4, 1, 1)
    std = torch.tensor([0.25] + NORM_A["std"]).view(1, 4, 1, 1)
    return (t - mean) / std, torch.from_numpy(y).long()


def unet(bands: int, **kw: Any) -> SMPModel:
    return SMPModel("Unet", ENCODER, in_channels=bands, num_classes=K,
                    options={"decoder_channels": [64, 32, 16, 16, 8]}, **kw)


def train(net: SMPModel, data: tuple[torch.Tensor, torch.Tensor], epochs: int, batch: int,
          lr: float, *, freeze_bn: str = "none", freeze_epochs: int = 0, enc_scale: float = 1.0,
          evaluate: Any = None, seed: int = 0) -> list[float]:
    """Plain epochs of AdamW on random flips of the crops; mIoU after each epoch."""
    g = torch.Generator().manual_seed(seed)
    make = __import__("functools").partial(torch.optim.AdamW, lr=lr, weight_decay=1e-4)
    opt = make(optimizer_groups(net, net.parameters(), make, enc_scale))
    loss = CrossEntropy(K)
    x, y = data
    curve = []
    for epoch in range(epochs):
        set_encoder_trainable(net, epoch >= freeze_epochs)
        net.train()
        freeze_batch_norm(net, freeze_bn)
        for idx in torch.randperm(len(x), generator=g).split(batch):
            xb, yb = x[idx], y[idx]
            if torch.rand(1, generator=g) < 0.5:
                xb, yb = xb.flip(-1), yb.flip(-1)
            opt.zero_grad()
            s, w = loss(net(xb), yb)
            (s / w).backward()
            opt.step()
        if evaluate is not None:
            curve.append(evaluate(net))
    return curve


@torch.no_grad()
def miou(net: SMPModel, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    net.eval()
    x, y = data
    pred = torch.cat([net(x[i : i + 4]).argmax(1) for i in range(0, len(x), 4)])
    cm = np.bincount((y.flatten() * K + pred.flatten()).numpy(), minlength=K * K).reshape(K, K)
    return float(np.nanmean(iou_from_confusion(cm)))


def pretrain(args: argparse.Namespace, folder: Path) -> tuple[Path, float]:
    torch.manual_seed(0)
    net = unet(3)
    data = domain_a(args.pretrain_tiles, 128)
    held = domain_a(16, 256)
    curve = train(net, data, args.pretrain_epochs, 8, 3e-3, evaluate=lambda m: miou(m, held))
    enc = {k.removeprefix("model."): v.contiguous() for k, v in
           net.net.encoder.state_dict().items()}  # timm's own layout: conv1.weight, ...
    path = folder / "encoder_domain_a.safetensors"
    save_file(enc, path, metadata={k: json.dumps(v) for k, v in NORM_A.items()})
    return path, curve[-1]


def compare(args: argparse.Namespace, folder: Path, load: list[Any]
            ) -> tuple[dict[str, list[list[float]]], float]:
    """Pretrain on domain A (its encoder saved in ``folder``), then per seed fine-tune it on
    domain B's few labels against the same network from scratch; mIoU curves on held-out B
    and the pretrained network's mIoU on domain A. The load average is added per seed."""
    weights, pre_miou = pretrain(args, folder)
    held = domain_b(900, 16, 256)
    curves: dict[str, list[list[float]]] = {"fine-tuned from domain A": [], "from scratch": []}
    for seed in range(args.seeds):
        few = domain_b(500 + seed, args.labels, 128)
        torch.manual_seed(seed)
        tuned = unet(4, encoder_weights=str(weights), band_map=[None, 0, 1, 2])
        curves["fine-tuned from domain A"].append(train(
            tuned, few, args.epochs, 4, 1e-3, freeze_bn="all", freeze_epochs=1, enc_scale=0.1,
            evaluate=lambda m: miou(m, held), seed=seed))
        torch.manual_seed(seed)
        curves["from scratch"].append(train(unet(4), few, args.epochs, 4, 1e-3,
                                            evaluate=lambda m: miou(m, held), seed=seed))
        load.append(os.getloadavg())
    return curves, pre_miou


def plot(curves: dict[str, list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in curves.items():
        a = np.array(runs)
        ep = np.arange(1, a.shape[1] + 1)
        ax.plot(ep, a.mean(0), marker="o", label=f"{name} (mean of {len(a)} seeds)")
        ax.fill_between(ep, a.min(0), a.max(0), alpha=0.2)
    ax.set_xlabel("epoch (domain B)")
    ax.set_ylabel("val mIoU (held-out domain-B scenes)")
    ax.set_title("Pretrained encoder vs from scratch (synthetic domains)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrain-tiles", type=int, default=256)
    p.add_argument("--pretrain-epochs", type=int, default=6)
    p.add_argument("--labels", type=int, default=16, help="labelled domain-B tiles")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="finetune_transfer", help="the result's benchmark name")
    add_harness_args(p, "32 pretraining tiles, 1 + 2 epochs, 1 seed")
    args = p.parse_args(argv)
    if args.quick:
        args.pretrain_tiles, args.pretrain_epochs, args.epochs, args.seeds = 32, 1, 2, 1
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="finetune_transfer_") as folder:
        curves, pre_miou = compare(args, Path(folder), load)
    png = args.out.with_suffix(".png") if args.out else RESULTS / f"{args.name}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(curves, png)
    final = {k: float(np.mean([c[-1] for c in v])) for k, v in curves.items()}
    save(args.name, {
        "what": "smp U-Net (tu-resnet18): encoder pretrained on synthetic domain A, saved as a "
                "timm-layout safetensors file, fine-tuned on synthetic domain B (other bands, "
                "other radiometry, few labels) vs the same network from scratch",
        "synthetic": "both domains are synthetic (SceneGenerator); the figure shows the "
                     "mechanics, not a claim about real imagery",
        "method": "Both domains" + __doc__.split("Both domains")[1].rstrip(),
        "config": vars(args), "pretrain_val_miou_domain_a": pre_miou,
        "miou_by_epoch": curves, "final_mean_miou": final, "plot": str(png.name),
        "loadavg": load, "wall_s": round(time.perf_counter() - t0)}, args.out)


if __name__ == "__main__":
    main()
