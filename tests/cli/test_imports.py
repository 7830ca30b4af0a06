"""What a command's start imports: every subprocess test and every rank pays it."""

from __future__ import annotations

import subprocess
import sys


def test_seg_predict_starts_without_the_libraries_only_polygons_or_compiling_need():
    """scipy (0.3 s here), pyogrio and geopandas load when polygons are written, not when
    ``seg-predict`` starts (scipy was loaded through the catalog's import of the vectors);
    ``torch._dynamo`` (1 s) when ``compile`` compiles a shape, not with the prediction
    modules every run and rank imports."""
    code = ("import sys, seg_at_scale.cli.predict\n"
            "print(sorted(m for m in ('scipy', 'pyogrio', 'geopandas') if m in sys.modules))\n"
            "import seg_at_scale.prediction.archive, seg_at_scale.prediction.scene\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "False"], out.stdout
