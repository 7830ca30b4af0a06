"""A run killed with SIGKILL mid-write leaves nothing under the final name; rerunning the
same call completes the file, equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import geopandas as gpd
import numpy as np
import shapely
from helpers import warm
from helpers.vectors import NAMES, make_labels, write_tiff

from seg_at_scale.vectors import write_vectors

CALL = "write_vectors({labels!r}, {out!r}, class_names={names!r}, strip_rows=4)"


def test_sigkill_mid_write_then_rerun(tmp_path):
    labels = write_tiff(tmp_path / "mask.tif", make_labels(751, 673, seed=7))
    out = tmp_path / "out.gpkg"
    call = CALL.format(labels=str(labels), out=str(out), names=NAMES)
    child = warm.popen(
        [sys.executable, "-c", f"from seg_at_scale.vectors import write_vectors; {call}"],
        env=os.environ.copy(), stderr=subprocess.PIPE)
    created = written = 0  # sizes of the temporary: as created, after the first batch
    deadline = time.monotonic() + 60
    while written <= created and time.monotonic() < deadline:
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        sizes = [p.stat().st_size for p in tmp_path.glob(".out.gpkg.partial.*[0-9a-f].gpkg")]
        created = created or max(sizes, default=0)
        written = max(sizes, default=0)
        time.sleep(0.002)
    assert written > created > 0 and child.poll() is None, "not killed mid-write"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not out.exists()
    assert [p.name for p in tmp_path.glob(".out.gpkg.partial.*")]  # the killed run's file

    eval(call, {"write_vectors": write_vectors})  # the same call again
    assert out.exists() and not list(tmp_path.glob(".out.gpkg.partial.*"))
    write_vectors(labels, tmp_path / "once.gpkg", class_names=NAMES, strip_rows=4)
    rerun, once = gpd.read_file(out), gpd.read_file(tmp_path / "once.gpkg")
    key = ["class_id", "pixels", "area"]
    rerun, once = (df.assign(wkb=shapely.to_wkb(shapely.normalize(df.geometry.to_numpy())))
                   .sort_values([*key, "wkb"]).reset_index(drop=True) for df in (rerun, once))
    assert len(rerun) == len(once) > 4096  # a first batch was in the file, more to come
    assert rerun[[*key, "class_name"]].equals(once[[*key, "class_name"]])
    assert np.array_equal(rerun.wkb, once.wkb)
    assert rerun.crs == once.crs and rerun.crs.to_epsg() == 32633
