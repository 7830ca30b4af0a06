"""Which prediction made a finished output: a rerun recognises its own work and skips it.

A finished ``.tif`` carries the digest of its fingerprint (model weights, input file,
grid, precision, TTA, ...) and its class histogram as GDAL metadata tags; a finished
``.zarr`` store carries the fingerprint itself. So rerunning the same command over a
finished output (or an archive whose scenes are partly finished) skips what is done,
completes what is missing (a preview, vectors, a STAC Item killed before being written),
and refuses an output another prediction made unless ``overwrite=true``.

What a prediction writes beside its output records which prediction wrote it, and a
content hash of what it wrote (:func:`written_by`): the preview in a ``tEXt`` chunk of the
PNG, the STAC Item in a property, the polygons in the record beside them
(:func:`vector_record`). A rerun keeps or completes only those; a file of the user's at a
companion's path (or one edited since) is refused unless ``overwrite=true``.

>>> digest({"model": "ab", "grid": [1, 2]}) == digest({"grid": [1, 2], "model": "ab"})
True
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, cast

__all__ = ["digest", "finished", "FINGERPRINT_TAG", "CLASS_PIXELS_TAG", "TILING_TAG",
           "PROBABILITIES_OF_TAG", "PREDICTION_TAG", "canonical", "recorded_fingerprint",
           "file_sha256", "file_blake3", "written_by", "owner", "owner_of", "mark_png",
           "mark_item", "vector_record", "WRITTEN_KEY"]

FINGERPRINT_TAG = "SEG_AT_SCALE_FINGERPRINT"
#: the probabilities COG's record: the prediction whose softmax it holds (:func:`owner`; not
#: FINGERPRINT_TAG, which marks a finished output: this file is none)
PROBABILITIES_OF_TAG = "SEG_AT_SCALE_PROBABILITIES_OF"
CLASS_PIXELS_TAG = "SEG_AT_SCALE_CLASS_PIXELS"
TILING_TAG = "SEG_AT_SCALE_TILING"  # exact, or approximate (tiling.exact=false)
#: the fingerprint itself (canonical JSON), that a refused rerun can name what differs
PREDICTION_TAG = "SEG_AT_SCALE_PREDICTION"
WRITTEN_KEY = "seg_at_scale:written"  # a companion's record: {"prediction" (owner), "sha256"}
_PNG = b"\x89PNG\r\n\x1a\n"


def canonical(fingerprint: dict[str, Any]) -> str:
    """A fingerprint's canonical JSON (what :func:`digest` hashes)."""
    return json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)


def digest(fingerprint: dict[str, Any]) -> str:
    """SHA-256 of a fingerprint's canonical JSON."""
    return "sha256:" + hashlib.sha256(canonical(fingerprint).encode()).hexdigest()


def recorded_fingerprint(output: Path) -> dict[str, Any] | None:
    """The fingerprint a finished output records (a store's, a COG's tag), if it does."""
    if output.suffix.lower() == ".zarr":
        import zarr

        try:
            found = zarr.open_group(output, mode="r").attrs.get("fingerprint")
        except (ValueError, KeyError, FileNotFoundError, OSError):
            return None
        return dict(cast(dict[str, Any], found)) if isinstance(found, dict) else None
    from rasterio.errors import RasterioIOError

    from seg_at_scale.io.geotags import open_dataset

    try:
        with open_dataset(output) as ds:
            text = ds.tags().get(PREDICTION_TAG)
        found = json.loads(text) if text else None
    except (RasterioIOError, OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def owner(digest: str, output: Path) -> str:
    """What a companion of ``output`` records as its writer: the prediction and its output.

    The prediction's digest alone is not enough: ``NAME.tif`` and ``NAME.zarr`` of one
    prediction share it, and their companions share names (``NAME_preview.png``,
    ``NAME.stac.json``), so each would have taken the other's as its own.
    """
    return f"{digest} {output.name}"


def owner_of(output: Path) -> str | None:
    """:func:`owner` of the prediction finished at ``output`` (None: none there)."""
    state = finished(output)
    return owner(state[0], output) if state else None


def finished(output: Path) -> tuple[str, list[int]] | None:
    """``(fingerprint digest, class pixels)`` of a finished prediction at ``output``.

    None when there is nothing there, or something that is not a finished seg_at_scale
    prediction (a file of the user's, an interrupted store).
    """
    if not output.exists():
        return None
    if output.suffix.lower() == ".zarr":
        return _finished_store(output)
    from rasterio.errors import RasterioIOError

    from seg_at_scale.io.geotags import open_dataset

    try:
        with open_dataset(output) as ds:
            tags = ds.tags()
    except (RasterioIOError, OSError):
        return None
    if FINGERPRINT_TAG not in tags:
        return None
    return tags[FINGERPRINT_TAG], json.loads(tags.get(CLASS_PIXELS_TAG, "[]"))


def _finished_store(path: Path) -> tuple[str, list[int]] | None:
    import zarr

    try:
        attrs = dict(zarr.open_group(path, mode="r").attrs)
    except (ValueError, KeyError, FileNotFoundError, OSError):
        return None
    if not attrs.get("complete") or "fingerprint" not in attrs:
        return None
    fingerprint = cast(dict[str, Any], attrs["fingerprint"])
    return digest(fingerprint), list(cast(list[int], attrs.get("class_pixels") or []))


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, streamed (about 1 GB/s with SHA extensions)."""
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


#: bytes read per BLAKE3 update: large enough for every core to hash a share of it
_BLAKE3_CHUNK = 16 * 2**20


def file_blake3(path: Path) -> str:
    """``blake3:<hex>`` of a file's bytes, hashed on every core (BLAKE3's tree mode).

    What a prediction's fingerprint names its input by: an 8192^2 4-band scene (230 MB)
    hashes in 0.06 s on 2 cores and 0.16 s by SHA-256, which is one core's work however
    many the machine has (``experiments/bench_input_hash.py``). Read in chunks rather than
    memory-mapped: a file truncated while it is hashed raises an error instead of killing
    the process (SIGBUS). A pool of its own per file (as fast as BLAKE3's ``AUTO``): the
    global pool ``AUTO`` uses has no threads in a forked child, whose hash then never ends.
    """
    import blake3

    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    h = blake3.blake3(max_threads=max(1, cores))
    buf = bytearray(_BLAKE3_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return "blake3:" + h.hexdigest()


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def vector_record(vector: Path) -> Path:
    """Beside a vector file, what it was made with and its hash (``.NAME.json``)."""
    return vector.with_name(f".{vector.name}.json")


def written_by(key: str, path: Path) -> str | None:
    """The prediction that wrote companion ``key`` at ``path`` (:func:`owner`).

    None when nothing records one: a file of the user's, or one changed since it was
    written (its content no longer hashes to the recorded value). ``key`` is
    ``preview``, ``stac``, ``vector`` or ``probabilities`` (a ``.tif`` output's softmax
    COG, whose tag records the prediction; its pixels are not hashed); other keys are
    never recorded.
    """
    try:
        if key == "probabilities":
            from seg_at_scale.io.geotags import open_dataset

            with open_dataset(path) as ds:
                return ds.tags().get(PROBABILITIES_OF_TAG)
        if key == "preview":
            body, mark = _png_mark(path.read_bytes())
            return _checked(mark, lambda: _sha256(body))
        if key == "stac":
            doc = json.loads(path.read_text())
            mark = doc.get("properties", {}).pop(WRITTEN_KEY, None)
            return _checked(mark, lambda: _sha256(_canonical(doc)))
        if key == "vector":
            record = json.loads(vector_record(path).read_text())
            if record.get("pending"):  # killed between writing the file and its record
                return record.get("output")
            return _checked({"prediction": record.get("output"), "sha256": record.get("sha256")},
                            lambda: file_sha256(path))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def _checked(mark: Any, content: Any) -> str | None:
    if not isinstance(mark, dict) or not mark.get("prediction") or not mark.get("sha256"):
        return None
    return str(mark["prediction"]) if content() == mark["sha256"] else None


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def mark_item(path: Path, prediction: str | None) -> None:
    """Record in the STAC Item at ``path`` that ``prediction`` wrote it (atomically)."""
    from seg_at_scale.io.writer import write_atomic

    doc = json.loads(path.read_text())
    doc["properties"].pop(WRITTEN_KEY, None)
    mark = {"prediction": prediction, "sha256": _sha256(_canonical(doc))}
    doc["properties"][WRITTEN_KEY] = mark
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))


def mark_png(png: bytes, prediction: str | None) -> bytes:
    """``png`` with a ``tEXt`` chunk recording that ``prediction`` wrote it (before IEND)."""
    body, _ = _png_mark(png)
    text = json.dumps({"prediction": prediction, "sha256": _sha256(body)})
    data = WRITTEN_KEY.encode() + b"\0" + text.encode("latin-1")
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + \
        struct.pack(">I", zlib.crc32(b"tEXt" + data))
    end = body.rindex(b"IEND") - 4
    return body[:end] + chunk + body[end:]


def _png_mark(png: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """The PNG without its record chunk, and the record (None: not a PNG, or no record)."""
    if not png.startswith(_PNG):
        raise ValueError("not a PNG")
    out, mark, at = [png[:8]], None, 8
    key = WRITTEN_KEY.encode() + b"\0"
    while at + 8 <= len(png):
        n, kind = struct.unpack(">I4s", png[at:at + 8])
        end = at + 12 + n
        if kind == b"tEXt" and png[at + 8:at + 8 + len(key)] == key:
            mark = json.loads(png[at + 8 + len(key):at + 8 + n].decode("latin-1"))
        else:
            out.append(png[at:end])
        at = end
    return b"".join(out), mark
