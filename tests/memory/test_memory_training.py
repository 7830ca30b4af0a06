"""Training under a memory mode, and precision choices."""


from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from helpers.memory import CONF, tiny
from hydra import compose, initialize_config_dir

from seg_at_scale.cli.training import check_memory
from seg_at_scale.errors import ConfigError
from seg_at_scale.memory import (
    MemoryConfig,
    MemoryReport,
    apply_memory_mode,
    check_precision,
)
from seg_at_scale.tasks import SegmentationTask
from seg_at_scale.tiling import predict_full, predict_tiled

# ----- Lightning: the task trains the same under a memory mode, and reports it --------------


def _batches(n: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"image": torch.randn(1, 3, 40, 56, generator=g),
             "target": torch.randint(0, 4, (1, 40, 56), generator=g),
             "norm": torch.tensor([40.0 * 56]), "last": torch.tensor([True])} for _ in range(n)]


def _fit(mode: str) -> tuple[dict[str, torch.Tensor], MemoryReport, pl.Trainer]:
    net = tiny("same")
    report = MemoryReport(mode)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[report], accelerator="cpu")
    task = SegmentationTask(apply_memory_mode(net, mode), 4, gradient_reduction="mean")
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(
        _batches(), batch_size=None))
    return net.state_dict(), report, trainer


def test_training_with_checkpointing_equals_none_and_reports_memory():
    ref, _, _ = _fit("none")
    got, report, trainer = _fit("checkpoint")
    for k in ref:
        assert torch.allclose(got[k], ref[k], atol=1e-6), k
    assert report.summary["steps"] == 2 and report.summary["memory_mode"] == "checkpoint"
    assert report.summary["peak_mem_mib"] > 50 and report.summary["mpix_per_s"] > 0
    assert "train/peak_mem_mib" in trainer.callback_metrics


# ----- precision ---------------------------------------------------------------------------


def test_precision_names_and_16_mixed_on_cpu_is_refused():
    assert check_precision("32", "cpu") == "32-true"
    assert check_precision("bf16", "cpu") == "bf16-mixed"
    assert check_precision("16-mixed", "gpu", cuda_available=True) == "16-mixed"
    with pytest.raises(ConfigError, match=r"16-mixed cannot run on this CPU.*bf16-mixed") as err:
        check_precision("16-mixed", "auto", cuda_available=False)
    # before: precision=32, which the command line reads as the number and refuses unquoted
    assert ", precision=32-true, or trainer=gpu on a CUDA machine" in str(err.value)
    with pytest.raises(ConfigError, match=r"trainer.precision='half'"):
        check_precision("half")


def test_old_and_new_precision_choices_compose():
    with initialize_config_dir(CONF, version_base="1.3"):
        for choice, name in [("'32'", "32-true"), ("32-true", "32-true"), ("bf16", "bf16-mixed"),
                             ("bf16-mixed", "bf16-mixed"), ("'16'", "16-mixed"),
                             ("16-mixed", "16-mixed")]:
            cfg = compose("train", overrides=[f"precision={choice}"])
            assert cfg.trainer.precision == name and cfg.memory.mode == "none"
        cfg = compose("train", overrides=["precision=16-mixed", "trainer.accelerator=cpu"])
    with pytest.raises(ConfigError, match="16-mixed cannot run"):
        check_memory(cfg)


def test_strip_blocks_compose_from_the_command_line():
    base = ["memory=checkpoint", "memory.granularity=strips"]
    with initialize_config_dir(CONF, version_base="1.3"):
        blocks = check_memory(compose("train", overrides=base))
        assert blocks.strip_cols == 1024 and blocks.label == "checkpoint:strips"
        assert MemoryConfig("checkpoint").label == "checkpoint"  # level: the default
        whole = check_memory(compose("train", overrides=[*base, "memory.strip_cols=null"]))
        assert whole.strip_cols is None and whole.strip_rows == 128
        bad = compose("train", overrides=[*base, "memory.strip_cols=9"])
    with pytest.raises(ConfigError, match=r"memory.strip_cols=9: use an even number"):
        check_memory(bad)


def test_bf16_tiled_labels_agree_with_untiled():
    net = tiny("same").eval()
    x = torch.randn(1, 3, 203, 171)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = predict_full(net, x).argmax(1)
    tiled = predict_tiled(net, x, q=3, autocast=torch.bfloat16).argmax(1)
    assert (tiled == full).float().mean().item() >= 0.999


def test_the_memory_line_is_shown_once_whether_or_not_logging_shows_it(capsys):
    """Under Hydra the line's log record reaches the console; printing it too showed it
    twice. Without a console handler (a notebook) it is printed."""
    import io
    import logging

    # the logging another test left in this worker (Hydra's handlers, pytest's) set aside
    root = logging.getLogger()
    before, handlers = root.level, root.handlers[:]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    try:
        root.handlers = []
        root.setLevel(logging.WARNING)  # nothing shows INFO: printed
        _fit("none")
        assert capsys.readouterr().out.count("memory=none precision=32-true: peak") == 1
        root.setLevel(logging.INFO)  # a console handler shows it (Hydra's): not printed
        root.addHandler(handler)
        _fit("none")
        shown = capsys.readouterr().out + stream.getvalue()
        assert shown.count("memory=none precision=32-true: peak") == 1
        assert "memory=none precision=32-true: peak" in stream.getvalue()
    finally:
        root.handlers = handlers
        root.setLevel(before)
