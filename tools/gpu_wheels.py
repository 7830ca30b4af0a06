"""Fetch, here, the wheels a lent GPU machine lacks, so `make gpu-check` runs there offline.

    .venv/bin/python tools/gpu_wheels.py    # -> .whl/ (about 56 MiB), .whl-codecs/ (26 MiB)
    bash tools/gpu_lent.sh --codecs         # there, carrying .whl-codecs/: imagecodecs
    bash tools/gpu_lent.sh                  # there, carrying .whl/: the rest, make gpu-check

A lent machine (an H200 of this project's workplace) has its own Python 3.12 with torch,
Lightning, timm, tifffile, numpy, scipy, OpenCV, pytest and xdist, and no network. This
script downloads the other packages the CUDA tests and ``bench_gpu.py`` import, at the
versions this venv holds, as CPython 3.12 manylinux wheels (``pip download``; the two
packages published only as source are built into pure-Python wheels). It leaves out what
only the CPU suite needs there (geopandas, optuna, pyproj, wandb), to stay within the
64 MiB a device call carries. imagecodecs, which a user's install has (tifffile inflates
DEFLATE with libdeflate through it, 1.6x faster than with zlib without it), goes into
``.whl-codecs/``, for a call of its own just before the check's, while the machine is still
warm.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import distributions, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what the CUDA tests and bench_gpu.py import that the lent machine's image lacks
WHEELS = ("hydra-core", "omegaconf", "segmentation-models-pytorch", "albumentations",
          "albucore", "stringzilla", "simsimd", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "rasterio", "affine", "click-plugins", "cligj", "shapely",
          "zarr", "numcodecs", "donfig", "google-crc32c", "monai",
          "blake3")  # and pystac's packages
SOURCE_ONLY = ("antlr4-python3-runtime", "fairscale")  # sdists: built into wheels here
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64")
LIMIT_MIB = 58  # a device call carries 64 MiB with the working tree (about 4 MiB)


def main(argv: list[str] | None = None) -> int:
    """Download and build the wheels; 1 when they would not fit in a device call."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    stac = sorted({d.metadata["Name"] for d in distributions()  # pystac and its extensions
                   if d.metadata["Name"].lower().startswith("pystac")})
    pins = [f"{name}=={version(name)}" for name in (*WHEELS, *stac)]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", args.python_version, "--implementation", "cp",
                    *platforms, "-d", str(args.dest), *pins], check=True)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(args.dest), *(f"{n}=={version(n)}" for n in SOURCE_ONLY)], check=True)
    codecs = args.dest.with_name(args.dest.name + "-codecs")
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", args.python_version, "--implementation", "cp",
                    *platforms, "-d", str(codecs), f"imagecodecs=={version('imagecodecs')}"],
                   check=True)
    size = sum(p.stat().st_size for p in args.dest.glob("*.whl")) / 2**20
    print(f"{len(list(args.dest.glob('*.whl')))} wheels, {size:.1f} MiB in {args.dest}")
    if size > LIMIT_MIB:
        print(f"over {LIMIT_MIB} MiB: a device call would not carry them with the tree; "
              f"remove old versions from {args.dest}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
