"""tcmalloc for the commands' CPU tensors, preloaded where it is installed.

glibc's ``malloc`` maps every block of 32 MiB or more afresh and unmaps it when it is freed.
A forward on the CPU allocates its activations (hundreds of MiB for a 2048² tile) and frees
them tile after tile, so the kernel maps and zeroes the same amount of memory again for every
forward: on the 2-core machine this project is developed on, the demo U-Net's bf16 forward
of one 1736² tile took 0.32-1.0 s under glibc and a steady 0.28 s under tcmalloc, which
keeps freed blocks for the next forward. ``experiments/bench_allocator.py`` (8192² scene,
alternated, three runs): ``seg-predict`` 1.26-1.37x faster (system time 5.9 → 0.9 s), staged
1.27-1.30x, ``seg-train`` 1.18-1.23x, peak memory -14 % to +6 %, the same labels. jemalloc,
as configured by default, returns its pages and was no faster here.

A command (``seg-train``, ``seg-predict``, ``seg-export``, ``seg-synth``, or ``python -m``
of their modules) re-executes itself once as it starts, before it imports anything else,
with ``LD_PRELOAD`` naming tcmalloc: the same process id, arguments and environment. What
the command starts inherits it: its ranks, and the Slurm jobs it submits (``sbatch`` passes
the environment on by default).
``SEG_AT_SCALE_MALLOC`` chooses:

* unset or ``auto``: tcmalloc where one is installed (Debian and Ubuntu:
  ``apt-get install libtcmalloc-minimal4``; conda: ``gperftools``), else glibc's;
* ``system``: glibc's;
* a path: that library (one that does not exist is refused, naming the variable).

An ``LD_PRELOAD`` the user set is left as it is, and nothing happens outside Linux. Importing
:mod:`seg_at_scale` or :mod:`seg_at_scale.cli` from Python (a notebook, a test) changes
nothing; :func:`preload` with ``command=False`` does it for a script (the benchmarks, which
compare against the commands), and :func:`run_under` starts another program under it (``make
test`` runs the test suite so, as the commands run).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

__all__ = ["preload", "run_under", "preloaded_library", "allocator", "find_tcmalloc", "ENV"]

ENV = "SEG_AT_SCALE_MALLOC"
COMMAND_MODULES = frozenset({"seg_at_scale.cli.train", "seg_at_scale.cli.predict",
                             "seg_at_scale.cli.export", "seg_at_scale.cli.synth"})
COMMAND_SCRIPTS = frozenset({"seg-train", "seg-predict", "seg-export", "seg-synth"})
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so",
          "libtcmalloc.so")
# tcmalloc reports each allocation of 1 GiB or more on stderr unless told otherwise
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 60)}


def _started(argv: Sequence[str]) -> tuple[str, str] | None:
    """What the interpreter runs: ``("module", name)``, ``("script", path)`` or None.

    None for ``-c`` and an interactive interpreter.
    """
    args = iter(argv[1:])
    for a in args:
        if a == "-m":
            return "module", next(args, "")
        if a == "-c":
            return None
        if a in ("-X", "-W"):
            next(args, None)
        elif not a.startswith("-"):
            return "script", a
    return None


def is_command(argv: Sequence[str]) -> bool:
    """Whether the interpreter's arguments (``sys.orig_argv``) start one of the commands.

    >>> is_command(["python", "-u", "-m", "seg_at_scale.cli.predict", "image=a.tif"])
    True
    >>> is_command(["/venv/bin/python", "/venv/bin/seg-train", "model=unet"])
    True
    >>> is_command(["python", "-c", "import seg_at_scale.cli"])
    False
    """
    started = _started(argv)
    if started is None:
        return False
    kind, name = started
    return name in COMMAND_MODULES if kind == "module" else Path(name).name in COMMAND_SCRIPTS


def _prog(argv: Sequence[str]) -> str:
    """The command's name: ``seg-predict`` for its script or its module.

    >>> _prog(["python", "-X", "dev", "-m", "seg_at_scale.cli.predict"])
    'seg-predict'
    """
    kind, name = _started(argv) or ("script", "seg-at-scale")
    return "seg-" + name.rsplit(".", 1)[-1] if kind == "module" else Path(name).name


def find_tcmalloc(env: Mapping[str, str] = os.environ) -> Path | None:
    """The first tcmalloc in this environment's and the system's library folders."""
    folders = [Path(sys.prefix) / "lib"]
    if env.get("CONDA_PREFIX"):
        folders.append(Path(env["CONDA_PREFIX"]) / "lib")
    multiarch = sysconfig.get_config_var("MULTIARCH")
    for root in ("/usr/lib", "/usr/local/lib", "/lib"):
        if multiarch:
            folders.append(Path(root) / str(multiarch))
        folders.append(Path(root))
    folders.append(Path("/usr/lib64"))
    for folder in folders:
        for name in _NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def preloaded_library(env: Mapping[str, str] = os.environ) -> Path | None:
    """The library a start should preload, or None (``ENV``, the user's ``LD_PRELOAD``).

    Raises:
        ValueError: ``SEG_AT_SCALE_MALLOC`` names a file that does not exist.
    """
    choice = env.get(ENV, "auto").strip() or "auto"
    if choice == "system" or env.get("LD_PRELOAD") or not sys.platform.startswith("linux"):
        return None
    if choice == "auto":
        return find_tcmalloc(env)
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ValueError(f"{ENV}={choice!r}: no such file; give the path of a malloc library "
                         "(libtcmalloc_minimal.so.4), 'auto' (tcmalloc where installed) or "
                         "'system' (glibc's)")
    return path


def preload(*, command: bool = True) -> None:
    """Re-execute this process with tcmalloc preloaded, where :func:`preloaded_library` says.

    ``command``: only when the process is one of the commands starting
    (:func:`is_command`); a script passes False. Returns where nothing is to be done (or the
    process could not be re-executed); otherwise it does not return.
    """
    argv = list(getattr(sys, "orig_argv", []))
    if not argv or (command and not is_command(argv)) or "torch" in sys.modules:
        return
    try:
        lib = preloaded_library()
    except ValueError as exc:  # before any work, as the commands refuse a bad key
        print(f"{_prog(argv)}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if lib is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], _preloading(lib))
    except OSError:  # the process goes on with glibc's malloc
        return


def _preloading(lib: Path) -> dict[str, str]:
    """This environment with ``lib`` preloaded (and tcmalloc's large-allocation reports off)."""
    return {**_QUIET, **os.environ, "LD_PRELOAD": str(lib)}


def run_under(cmd: Sequence[str]) -> NoReturn:
    """Replace this process by ``cmd`` under the malloc a command would preload.

    ``cmd`` is a program (looked up on ``PATH``) and its arguments; the library is
    :func:`preloaded_library`'s: the same choice, the same refusal of a missing library
    (exit status 2). ``make test`` runs the suite so, as the commands run.
    """
    if not cmd:
        raise ValueError("run_under: no program to run")
    try:
        lib = preloaded_library()
    except ValueError as exc:
        print(f"{cmd[0]}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], list(cmd), os.environ if lib is None else _preloading(lib))


def allocator() -> str:
    """The malloc this process runs: ``tcmalloc``, ``jemalloc``, ``mimalloc`` or ``system``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"
