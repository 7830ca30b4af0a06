"""``seg-synth``: write the embedded synthetic dataset, or one (huge) synthetic scene.

Examples::

    seg-synth --out data/synthetic                       # train 8 / val 2 / test 1, 1024^2
    seg-synth --out data/big --height 4096 --width 4096 --train 4 --val 1 --test 1
    seg-synth --single scene.tif scene_mask.tif --height 50000 --width 50000

The scene is streamed in bands of rows, so memory stays bounded at any size; the command
prints the paths written and the throughput.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from seg_at_scale.cli.common import reports_errors
from seg_at_scale.config_check import check_local
from seg_at_scale.data.sources.synthetic import make_dataset, write_scene
from seg_at_scale.data.synthetic import SceneGenerator
from seg_at_scale.errors import ConfigError, OutputExistsError
from seg_at_scale.prediction.checks import same_path

__all__ = ["build_parser", "main"]

COMPRESSIONS = ("none", "zlib", "deflate", "lzma", "zstd", "lzw", "packbits")


def build_parser() -> argparse.ArgumentParser:
    """Build the ``seg-synth`` argument parser."""
    p = argparse.ArgumentParser(prog="seg-synth", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", help="dataset folder (dataset mode)")
    p.add_argument("--single", nargs=2, metavar=("IMAGE_PATH", "MASK_PATH"),
                   help="write one scene of --height x --width instead of a dataset")
    p.add_argument("--height", type=int, default=1024, help="scene height in pixels")
    p.add_argument("--width", type=int, default=1024, help="scene width in pixels")
    p.add_argument("--seed", type=int, default=0, help="dataset / scene seed")
    p.add_argument("--train", type=int, default=8, help="training scenes")
    p.add_argument("--val", type=int, default=2, help="validation scenes")
    p.add_argument("--test", type=int, default=1, help="test scenes")
    p.add_argument("--band-rows", type=int, default=1024,
                   help="rows rendered per step in --single mode (bounds memory)")
    p.add_argument("--compression", default="zlib", choices=COMPRESSIONS,
                   help="TIFF compression in --single mode ('none' for raw: fastest)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return p


def _run(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    for what, path in [*(("--single", p) for p in args.single or ()), ("--out", args.out)]:
        if path:
            check_local(f"{what} '{path}'", path, output=True)  # before any folder is made
    if args.single:
        image, mask = (Path(p) for p in args.single)
        if same_path(image, mask):
            raise ConfigError(f"--single: the image and the mask are the same file '{image}'; "
                              "give two paths (e.g. scene.tif scene_mask.tif)")
        for path in (image, mask):
            if path.exists() and not args.overwrite:
                raise OutputExistsError(f"'{path}' already exists; pass --overwrite to "
                                        "replace it (or choose another path)")
        gen = SceneGenerator(args.seed, args.height, args.width)
        compression = None if args.compression.lower() == "none" else args.compression
        paths: tuple[Path, ...] = write_scene(image, mask, gen, band_rows=args.band_rows,
                            compression=compression, overwrite=args.overwrite)
        pixels = args.height * args.width
    else:
        splits = {"train": args.train, "val": args.val, "test": args.test}
        manifest = make_dataset(args.out, splits=splits, height=args.height, width=args.width,
                                seed=args.seed, overwrite=args.overwrite)
        paths = (manifest.path, *manifest.all_files())
        pixels = sum(splits.values()) * args.height * args.width
    seconds = time.perf_counter() - start
    for path in paths:
        print(path)
    print(f"{pixels / 1e6:.1f} Mpix in {seconds:.2f} s: {pixels / 1e6 / seconds:.1f} Mpix/s "
          "(image + mask, rendered and written; a reused dataset is not rewritten)")


@reports_errors("seg-synth")
def main(argv: Sequence[str] | None = None) -> int:
    """Run ``seg-synth``.

    Args:
        argv: arguments without the program name; None reads ``sys.argv``.

    Returns:
        0 on success.

    Raises:
        SystemExit: status 2 for a usage or input error (the message alone on stderr).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.single) == bool(args.out):
        parser.error("give exactly one of --out DIR (a dataset) or --single IMAGE MASK")
    _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
