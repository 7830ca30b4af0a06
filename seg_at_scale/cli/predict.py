"""Predict a whole image file with a trained model, streaming tiles, exactly as untiled.

Run it::

    seg-predict run=runs/same_unet_small/<date> image=scene.tif output=scene_mask.tif
    seg-predict model=unet_small.segmodel image=scene.tif output=scene_mask.tif
    seg-predict run=... image=big.tif output=big_mask.tif tile_size=2048 fast=false
    seg-predict run=... image=a.tif output=a_mask.tif mask=a_truth.tif   # also scores it
    seg-predict run=... image=big.tif output=big_mask.zarr processes=2   # 2 processes, zarr
    seg-predict run=... image=a.tif output=a_mask.tif probabilities=uint8 tta=d4

``output=*.tif`` is a Cloud-Optimized GeoTIFF (uint8 labels, 255 = no data, the input's
georeferencing, a colour table, mode overviews); ``output=*.zarr`` a Zarr v3 store. Both
are computed into a Zarr store first: a killed run rerun with the same command continues
from the tiles already written (``resume=false`` starts afresh). A PNG preview is drawn
beside the output. ``processes=N`` spreads the tiles over N local processes (gloo on CPU,
NCCL on GPUs); under SLURM ``nodes`` x ``processes`` ranks come from the cluster.

Every key is checked, and every input against the model, before any rank starts
(:mod:`seg_at_scale.prediction.checks`); the model is built from the registry and its
checkpoint read as plain data (``trust_run=true`` lifts both, for a sender you trust).
The output's lock (an archive's own) is the first work, before torch is even imported: of
two commands writing one output the first started wins, and the other is refused at once.
A rank killed by a signal (the OOM killer) ends the run within seconds, in one line naming
the rank and the signal; the same command resumes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import hydra
from omegaconf import DictConfig, OmegaConf

from seg_at_scale.cli.common import (
    USER_ERROR_EXIT,
    disk_full,
    format_iou,
    long_lived,
    reports_errors,
)
from seg_at_scale.config_check import check_local, check_types, known_keys
from seg_at_scale.errors import ConfigError, SegAtScaleError
from seg_at_scale.parallel.environment import launcher, plain_environment, quiet_srun_hint
from seg_at_scale.parallel.lifetime import RankWatch, die_with_parent
from seg_at_scale.prediction.lock import scene_lock
from seg_at_scale.prediction.outputs import output_kind

if TYPE_CHECKING:  # the network stack is imported after the output lock (_claim_output)
    import torch

    from seg_at_scale.prediction.options import PredictOptions

log = logging.getLogger("seg_at_scale.predict")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf_predict")  # shipped in the wheel
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # ranks that never meet fail, they do not hang
_LAUNCHER: list[int] = []  # pid of the process that forks the ranks
_REPORTED: list[Any] = []  # shared with the forked ranks: whether one printed the error
_WATCH: list[RankWatch] = []  # shared with the forked ranks: their pids and own ends
#: the keys that name files or folders: read, and written
READ = ("image", "images", "mask", "masks", "run", "model", "ckpt")
WRITTEN = ("output", "output_dir", "vector")
# set by a rank (or the process that starts the ranks) alone; "0" (or unset) in rank 0
_RANK_VARIABLES = ("RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "SLURM_PROCID")


def _default_options() -> PredictOptions:
    from seg_at_scale.prediction.options import PredictOptions

    return PredictOptions()


@dataclass(frozen=True)
class PredictJob:
    """``seg-predict``'s keys, validated: the model, the scenes, where it runs, how.

    With :class:`~seg_at_scale.prediction.options.PredictOptions` (``options``, every other
    key), the one source of the command's keys: their defaults (``conf_predict/predict.yaml``
    must hold the same values, a test checks it) and ``seg-predict --help``.

    Attributes:
        image: the raster to predict: a (Geo)TIFF / BigTIFF, or any raster GDAL opens (a VRT
            mosaic, JPEG 2000, ...).
        output: <name>.tif (Cloud-Optimized GeoTIFF) or <name>.zarr (Zarr v3).
        images: or many scenes: a folder (its .tif / .tiff files; a split folder of
            <name>_image.tif + <name>_mask.tif or images/ + masks/: its images, named <name>),
            a glob (any raster, e.g. 'mosaics/*.vrt'), a .txt list or a STAC JSON file.
        output_dir: images=: the scenes are written as <output_dir>/<stem>.<output_format>,
            with summary.csv/json, mosaic.vrt and items.json.
        output_format: images=: tif or zarr.
        masks: images=: a folder of truth rasters <stem>.tif or <stem>_mask.tif, or a
            split folder with masks/<stem>.tif (IoU per scene).
        on_error: images=: stop (refuse bad scenes) or skip (record them, predict the others).
        vector_merge: images=: one vectors.<ext> with a scene column, not one file per scene.
        run: a training run folder (run_config.yaml + checkpoints/); give run= or model=.
        model: a model made by seg-export (.segmodel file or folder).
        ckpt: run= only: best (null), last, the name of one in checkpoints/ or a path.
        trust_run: build any model class and unpickle any checkpoint (runs code: only for a
            sender you trust).
        mask: ground truth of image=: also print per-class IoU and mIoU.
        vector: also the polygons: <name>.gpkg, .parquet or .fgb (images=: gpkg, parquet or
            fgb).
        device: auto, cpu, cuda or cuda:<index>.
        processes: local processes sharing the tiles (gloo on CPU, NCCL on GPUs).
        nodes: nodes, inside a Slurm job or a torchrun launch only.
    """

    image: str | None = None
    output: str | None = None
    images: str | None = None
    output_dir: str | None = None
    output_format: Literal["tif", "zarr"] = "tif"
    masks: str | None = None
    on_error: Literal["stop", "skip"] = "stop"
    vector_merge: bool = False
    run: str | None = None
    model: str | None = None
    ckpt: str | None = None
    trust_run: bool = False
    mask: str | None = None
    vector: str | None = None
    device: str = "auto"
    processes: int = 1
    nodes: int = 1
    options: PredictOptions = field(default_factory=_default_options)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> PredictJob:
        """Every key checked (unknown, missing, type, range) before any work."""
        from seg_at_scale.prediction.options import PredictOptions

        values = _values(cfg)
        own = [f.name for f in fields(cls) if f.name != "options"]
        known_keys("", values, [*own, *PredictOptions.names()])
        job = cls.own_keys(values)
        opts = PredictOptions.from_mapping({k: v for k, v in values.items() if k not in own})
        if not job.get("vector"):  # the polygons' keys set without polygons: not ignored
            plain = PredictOptions()
            for key in ("vector_connectivity", "vector_min_area", "vector_simplify",
                        "vector_classes"):
                if getattr(opts, key) != getattr(plain, key):
                    raise ConfigError(f"{key}={values[key]} is for polygons, and no vector= "
                                      "was given: add vector=<name>.gpkg (.parquet, .fgb; an "
                                      f"archive: vector=gpkg), or leave {key} out")
        return cls(options=opts, **job)

    @classmethod
    def own_keys(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The command's own keys (not the options), checked: the mode, types, ranges.

        No torch needed: run before the output lock is taken (:func:`_claim_output`).
        """
        _check_mode(values)
        own = [f.name for f in fields(cls) if f.name != "options"]
        job = {k: values[k] for k in own if k in values}
        hints = typing.get_type_hints(cls, localns={"PredictOptions": object})
        check_types("", job, {k: v for k, v in hints.items() if k != "options"})
        for key in ("processes", "nodes"):
            if job.get(key, 1) < 1:
                raise ConfigError(f"{key}={job[key]}: give a whole number >= 1 (e.g. {key}=2)")
        for key in (*READ, *WRITTEN):
            if job.get(key):
                check_local(f"{key}='{job[key]}'", str(job[key]), output=key in WRITTEN)
        if job.get("output") and not job.get("images"):
            output_kind(Path(job["output"]))  # before its lock is named after it
        device = str(job.get("device", "auto"))
        if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
            raise ConfigError(f"device={device!r}: use auto, cpu, cuda or cuda:<index>")
        return job

    @property
    def archive(self) -> bool:
        return self.images is not None

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but CUDA is not available; use "
                              "device=cpu")
        return torch.device(self.device)


def _values(cfg: DictConfig) -> dict[str, Any]:
    values = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(values, dict)
    return {str(k): v for k, v in values.items()}


def _check_mode(values: dict[str, Any]) -> None:
    """One scene (``image=`` + ``output=``) or an archive (``images=`` + ``output_dir=``)."""
    one = [k for k in ("image", "output", "mask") if values.get(k) not in (None, "")]
    many = [k for k in ("images", "output_dir", "masks") if values.get(k) not in (None, "")]
    if one and many:
        raise ConfigError(f"{one[0]}= and {many[0]}= were both given: predict one scene "
                          "(image=, output=, mask=) or an archive (images=, output_dir=, "
                          "masks=), not both")
    need = ("images", "output_dir") if many else ("image", "output")
    for key in need:
        if values.get(key) in (None, ""):
            raise ConfigError(f"{key}= is missing: give seg-predict {key}=<path> (see "
                              "seg-predict --help)")
    if not many:  # keys of an archive alone, set away from their defaults: not ignored
        for key, default, fix in _ARCHIVE_ONLY:
            if key in values and values[key] != default:
                raise ConfigError(f"{key}={values[key]} is for images= (an archive); with "
                                  f"image= {fix}")


#: Keys an archive alone reads: (key, default, what to do instead with image=).
_ARCHIVE_ONLY = (("output_format", "tif", "the output's extension chooses (.tif or .zarr)"),
                 ("on_error", "stop", "a bad scene is refused; leave on_error out"),
                 ("vector_merge", False, "vector=<name>.gpkg is the one polygon file"))


def run_prediction(cfg: DictConfig, *, fork: bool = False) -> dict[str, Any]:
    """Predict ``cfg.image`` into ``cfg.output`` with ``cfg.run`` or ``cfg.model``.

    Every check runs here, in this process, before any rank starts. With ``processes`` x
    ``nodes`` > 1 this process then launches (or joins) the ranks and returns rank 0's
    result. ``fork=True`` (the command line) forks the local CPU ranks from this process,
    which has run no torch computation yet; a caller that has already run torch code keeps
    the default, since OpenMP does not survive a fork.
    """
    from seg_at_scale.cli.archive import archive_work
    from seg_at_scale.models.loading import model_files, peek_card
    from seg_at_scale.prediction.checks import check_scene

    job = PredictJob.from_config(cfg)
    device = job.torch_device()
    ranks = job.processes * job.nodes
    if job.nodes > 1:
        _check_cluster(job.nodes)
    card, source = peek_card(job.run, job.model, job.ckpt)
    files = model_files(job.run, job.model, job.ckpt)
    if job.archive:
        work = archive_work(job, card, source, files, device.type == "cuda")
    else:
        assert job.image is not None and job.output is not None  # PredictJob checked the mode
        check_scene(Path(job.image), Path(job.output), job.options,
                    card=card, source=source, model_files=files,
                    mask=Path(job.mask) if job.mask else None, ranks=ranks,
                    cuda=device.type == "cuda",
                    vector=Path(job.vector) if job.vector else None)
        work = None
    if ranks > 1:
        return _launch(job, device, fork, work)
    return _predict(job, device, work)


def _launched(fabric: Any, job: PredictJob, forked: bool, work: Any) -> dict[str, Any]:
    """Rank 0's result of :func:`_rank_main` on every rank (Fabric passes itself first)."""
    launch = typing.cast(Callable[..., dict[str, Any]], fabric.launch)
    return launch(_rank_main, job, forked, work)


def _check_cluster(nodes: int) -> None:
    """``nodes > 1`` needs a launcher that starts the ranks (Slurm, torchrun, LSF, MPI)."""
    if launcher() is None:
        raise ConfigError(f"nodes={nodes} but this is not a SLURM job or a torchrun launch "
                          "(nor jsrun or mpirun), so no other node would ever join; run it "
                          "inside sbatch / srun (or "
                          "hydra/launcher=slurm_predict), or use nodes=1 processes=<N>")


def _predict(job: PredictJob, device: torch.device, work: Any = None) -> dict[str, Any]:
    """This rank's share of the prediction (everything, with one process)."""
    import torch

    from seg_at_scale.cli.archive import predict_archive_job
    from seg_at_scale.cli.malloc import allocator
    from seg_at_scale.models.loading import load_trained
    from seg_at_scale.prediction.scene import predict_scene

    trained = load_trained(job.run, job.model, ckpt=job.ckpt, trust=job.trust_run)
    trained.model.to(device)
    if work is not None:
        return predict_archive_job(job, trained, work)
    assert job.image is not None and job.output is not None  # PredictJob checked the mode
    res = predict_scene(trained, Path(job.image), Path(job.output), job.options,
                        mask=Path(job.mask) if job.mask else None, checked=True,
                        vector=Path(job.vector) if job.vector else None)
    res["model"] = trained.source
    if trained.checkpoint is not None:
        res["checkpoint"] = str(trained.checkpoint)
    res["halo"] = trained.footprint.halo
    res["threads"] = torch.get_num_threads()  # per process
    res["allocator"] = allocator()  # tcmalloc where preloaded (seg_at_scale.cli.malloc)
    if "miou" in res:
        log.info("scores:\n%s", format_iou(res, trained.class_names))
    return res


def _launch(job: PredictJob, device: torch.device, fork: bool, work: Any) -> dict[str, Any]:
    """Start (or join) the ranks of a multi-process prediction; rank 0's result.

    Lightning Fabric launches them: on one machine's CPU (and ``fork``) by forking this
    process; otherwise its DDP launcher re-runs this command for local ranks 1..N-1, and
    on a SLURM allocation (or under torchrun) the cluster environment gives every rank.
    """
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    external = launcher() is not None
    forked = (fork and device.type == "cpu" and job.nodes == 1 and not external
              and "fork" in multiprocessing.get_all_start_methods())
    strategy = DDPStrategy(start_method="fork" if forked else "popen",
                           timeout=RENDEZVOUS_TIMEOUT)
    quiet_srun_hint()
    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu",
                    devices=job.processes, num_nodes=job.nodes, strategy=strategy,
                    plugins=plain_environment() or None)
    if not forked:
        return _launched(fabric, job, False, work)
    import torch

    _LAUNCHER[:] = [os.getpid()]  # the forked ranks' parent
    _REPORTED[:] = [multiprocessing.Value("b", 0)]  # inherited by every forked rank
    watch = RankWatch(job.processes)
    _WATCH[:] = [watch]
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    quiet = _QuietStops()
    spawn_log.addFilter(quiet)
    watch.watch()
    try:
        return _launched(fabric, job, True, work)
    except torch.multiprocessing.ProcessExitedException as exc:
        if exc.exit_code in (130, 143):
            raise (Stopped(signal.SIGTERM) if exc.exit_code == 143 else KeyboardInterrupt()
                   ) from None
        if exc.exit_code < 0:
            raise RankKilled(exc.error_index, job.processes, exc.error_pid,
                             -exc.exit_code) from None
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:  # this process was signalled: stop the ranks too
        for child in multiprocessing.active_children():
            child.terminate()
        raise
    finally:
        watch.stop()
        spawn_log.removeFilter(quiet)


class _QuietStops(logging.Filter):
    """Drop torch's "Terminating process N via signal SIGTERM" lines.

    The launcher says which rank ended the run, and why, in one line of its own.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Terminating process", "Unable to shutdown"))


class RankKilled(Exception):
    """A forked rank was killed by a signal (the OOM killer, ``kill -9``): the run ended."""

    def __init__(self, rank: int, ranks: int, pid: int, signum: int) -> None:
        self.rank, self.ranks, self.pid, self.signum = rank, ranks, pid, signum
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        oom = (" (what the out-of-memory killer sends: fewer processes or a smaller "
               "tile_size need less memory)" if signum == signal.SIGKILL else "")
        super().__init__(f"rank {rank} of {ranks} (pid {pid}) was killed by {name}{oom}, and "
                         "the other ranks were stopped; run the same command again to resume: "
                         "the completed tiles are kept")

    @property
    def exit_status(self) -> int:
        """The shell's status of a process killed by that signal (137 for SIGKILL)."""
        return 128 + self.signum


def _rank_main(fabric: Any, job: PredictJob, forked: bool, work: Any) -> dict[str, Any]:
    """One rank of a multi-process prediction.

    A forked rank dies with the launching process (even a SIGKILLed one: the kernel sends it
    SIGKILL, and its output lock goes with it), and ends a refused input or a stop by its
    exit status; the launcher turns that into its own. The message is printed by the first
    rank that raises one, whichever it is (an archive's failing scene may be rank 1's
    alone), and only by that rank (a refusal every rank raises prints once). A forked rank
    tells the launcher's :class:`~seg_at_scale.parallel.lifetime.RankWatch` its pid and
    its own end, so that a rank killed by a signal is told from one that ended itself.
    """
    import torch

    from seg_at_scale.parallel.launch import close_group

    if not forked:  # a launcher's rank (Slurm, torchrun, Fabric's popen): ends by exiting
        try:
            _set_threads(fabric, job, torch)
            return _predict(job, fabric.device, work)
        finally:
            close_group()
    die_with_parent(_LAUNCHER[0] if _LAUNCHER else None)
    watch = _WATCH[0] if _WATCH else None
    rank = fabric.global_rank
    if watch is not None:
        watch.started(rank)
    status = 1  # an error of its own, raised on to torch's launcher
    try:
        _set_threads(fabric, job, torch)
        res = _predict(job, fabric.device, work)
        status = 0
        return res
    except (SegAtScaleError, OSError) as exc:
        own = exc if isinstance(exc, SegAtScaleError) else disk_full(exc)
        if own is None:
            raise
        _report_once(f"seg-predict: error: {own}")
        status = USER_ERROR_EXIT
    except KeyboardInterrupt as exc:
        status = 143 if isinstance(exc, Stopped) else 130
    finally:
        if watch is not None:
            watch.ending(rank, status)
    sys.stderr.flush()
    os._exit(status)  # every rank the same way; the launcher stops the others


def _set_threads(fabric: Any, job: PredictJob, torch: ModuleType) -> None:
    if fabric.device.type == "cpu":  # OMP_NUM_THREADS, or this process's share of the cores
        threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
        torch.set_num_threads(threads or max(1, _cores() // job.processes))


def _report_once(line: str) -> None:
    """Print ``line`` on stderr unless another forked rank already printed its error."""
    if not _REPORTED:
        print(line, file=sys.stderr, flush=True)
        return
    flag = _REPORTED[0]
    with flag.get_lock():
        if flag.value:
            return
        flag.value = 1
        print(line, file=sys.stderr, flush=True)


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Stopped(KeyboardInterrupt):
    """SIGTERM (what SLURM sends before a kill): unwinds like Ctrl-C."""


def _terminate(signum: int, _: Any) -> None:
    raise Stopped(signum)


def _first_rank() -> bool:
    """Whether this process is rank 0 or the one that starts the ranks.

    Told by the environment alone (before torch): a rank started by Lightning, SLURM or
    torchrun has its rank (or its node's) in one of :data:`_RANK_VARIABLES`.
    """
    return all(os.environ.get(k, "0").strip() in ("", "0") for k in _RANK_VARIABLES)


@contextlib.contextmanager
def _claim_output(cfg: DictConfig) -> Iterator[None]:
    """The command's output lock, held for the whole run, taken before torch is imported.

    The cheap checks run first (:meth:`PredictJob.own_keys`: the mode, types, ranges);
    then rank 0 (or the process that starts the ranks) takes the output's lock, or for an
    archive its own lock (``<output_dir>/archive``), through
    :func:`~seg_at_scale.prediction.lock.scene_lock`. Of two commands writing one output,
    the first to start wins, and the other is refused in a fraction of a second, not after
    the seconds that importing torch and Lightning and loading the model take; the lock the
    scene and archive code take later in this process, or in a rank it forks, is this one.
    Folders made for the lock are removed again if the run leaves them empty (a refusal).
    """
    values = _values(cfg)
    job = PredictJob.own_keys(values)
    if not _first_rank():
        yield
        return
    if job.get("images") not in (None, ""):
        folder = Path(job["output_dir"])
        target, what = folder / "archive", f"output_dir '{folder}'"
    else:
        target, what = Path(job["output"]), None
    made = [f for f in (target.parent, *target.parent.parents) if not f.exists()]
    try:
        with scene_lock(target, what):
            yield
    finally:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break  # holds the outputs


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="predict")
@reports_errors("seg-predict")
def _main(cfg: DictConfig) -> None:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        with _claim_output(cfg):
            with long_lived():  # the network stack, once the output is claimed
                from seg_at_scale.cli import archive  # noqa: F401
                from seg_at_scale.models import loading  # noqa: F401
            res = run_prediction(cfg, fork=True)
    except KeyboardInterrupt as exc:
        what = "SIGTERM" if isinstance(exc, Stopped) else "Ctrl-C"
        print(f"seg-predict: stopped by {what}; the finished tiles are kept in the store: run "
              "the same command again to resume", file=sys.stderr, flush=True)
        raise SystemExit(143 if isinstance(exc, Stopped) else 130) from None
    except RankKilled as exc:
        print(f"seg-predict: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_status) from None
    if _first_rank():  # every rank has left its group by now
        print(json.dumps(res, indent=2))


USAGE = """seg-predict: predict whole rasters with a trained model, tile by tile, exactly.

Usage: seg-predict run=<training run folder> image=<raster> output=<name>.tif|.zarr [key=value ...]
       seg-predict model=<name>.segmodel images=<folder|glob|list|STAC> output_dir=<folder>
"""

EXAMPLES = """Examples:
  seg-predict run=runs/same_unet_small/2026-11-25_10-00-00 image=scene.tif output=mask.tif
  seg-predict model=unet_small.segmodel image=big.tif output=big.zarr processes=2 fast=true
  seg-predict run=... image=a.tif output=a_mask.tif mask=a_truth.tif tta=d4
  seg-predict run=... image=a.tif output=a_mask.tif vector=a_buildings.gpkg vector_classes=[4]
  seg-predict run=... images=scenes/ output_dir=out/ processes=2 vector=gpkg on_error=skip
  sbatch --nodes=2 --wrap "srun seg-predict run=... image=big.tif output=big.tif nodes=2"

Paths with spaces: quote the value for Hydra too, e.g. "image='my scene.tif'".
"""


def help_text(width: int = 100) -> str:
    """``seg-predict --help``: every key, its default and its meaning, made from the fields."""
    import re
    import textwrap

    from seg_at_scale.prediction.options import PredictOptions, field_docs

    def value(v: Any) -> str:
        return "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    job, opts = PredictJob.__dataclass_fields__, PredictOptions()
    rows = [(k, value(f.default), doc) for k, doc in field_docs(PredictJob).items()
            for f in [job[k]]]
    rows += [(k, value(getattr(opts, k)), doc) for k, doc in PredictOptions.docs().items()]
    lines = [USAGE, "Keys (default):"]
    for key, default, doc in rows:
        head = f"  {key}={default}"
        first = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "").replace('"', "")
        lines += textwrap.wrap(first, width, initial_indent=f"{head:<28}",
                               subsequent_indent=" " * 28) if len(head) < 28 else \
            [head, *textwrap.wrap(first, width, initial_indent=" " * 28,
                                  subsequent_indent=" " * 28)]
    return "\n".join([*lines, "", EXAMPLES])


def main() -> None:
    """Console entry point ``seg-predict``.

    On SIGTERM or Ctrl-C the run unwinds: temporary files are removed, the store keeps every
    finished tile, and the same command resumes (exit 143 / 130).
    """
    from seg_at_scale.cli.overrides import precheck

    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(help_text())
        return
    precheck("seg-predict", "predict")
    _main()


def entry() -> None:
    """``seg-predict`` as a command: :func:`main`, then the process ends at once.

    Without wandb, which it never uses: timm (any smp or timm model) would import it.
    """
    from seg_at_scale.cli.common import exit_now, keep_out

    keep_out("wandb")
    exit_now(main)


if __name__ == "__main__":
    entry()
