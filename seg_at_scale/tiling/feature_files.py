"""Feature maps kept in files, read and written window by window (staged tiling's store).

A :class:`DiskMap` is a ``[B, C, h, w]`` map stored channels-last, one row of pixels after
another. Nothing is mapped into the process: a window is read with one ``pread`` per row
into a fresh channels-last tensor, and a core written with one ``pwrite`` per row, so the
process holds the windows alone (the file sits in the page cache, which the kernel can
drop). A short read or write (the disk full) raises ``OSError`` naming the file.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> m = DiskMap(d / "m.bin", (1, 3, 5, 7), torch.float32)
>>> x = torch.arange(105.).reshape(1, 3, 5, 7)
>>> m.write(slice(0, 5), slice(0, 7), x)
>>> torch.equal(m.read(slice(1, 4), slice(2, 6)), x[..., 1:4, 2:6])
True
>>> m.close(); (d / "m.bin").exists()
False
>>> d.rmdir()
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DiskMap"]


class DiskMap:
    """A ``[B, C, h, w]`` feature map in the file ``path`` (created; removed by close).

    Attributes:
        shape: ``[B, C, h, w]``.
        dtype: of the stored values.
    """

    def __init__(self, path: Path, shape: tuple[int, ...] | torch.Size,
                 dtype: torch.dtype) -> None:
        self.path, self.shape, self.dtype = Path(path), torch.Size(shape), dtype
        self._item = torch.empty((), dtype=dtype).element_size()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(self._fd, self.shape.numel() * self._item)
        except OSError as exc:  # a file larger than the file system allows (EFBIG)
            self.close()
            raise self._named(exc) from exc

    def _named(self, exc: OSError) -> OSError:
        """``exc`` naming this map's file (a full disk then says where)."""
        return OSError(exc.errno, exc.strerror, str(self.path))

    def _offset(self, b: int, r: int, c: int) -> int:
        _, ch, h, w = self.shape
        return ((b * h + r) * w + c) * ch * self._item

    def _span(self, rows: slice, cols: slice) -> tuple[int, int, int, int]:
        r0, r1, _ = rows.indices(self.shape[2])
        c0, c1, _ = cols.indices(self.shape[3])
        return r0, max(r1, r0), c0, max(c1, c0)

    def read(self, rows: slice, cols: slice) -> Tensor:
        """The window ``[B, C, rows, cols]`` (channels-last strides)."""
        r0, r1, c0, c1 = self._span(rows, cols)
        b_n, ch = self.shape[0], self.shape[1]
        buf = torch.empty(b_n, r1 - r0, c1 - c0, ch, dtype=self.dtype)
        raw = buf.view(torch.uint8).numpy() if buf.numel() else None
        for b in range(b_n if raw is not None else 0):
            for i in range(r1 - r0):
                row = raw[b, i]  # type: ignore[index]
                if os.preadv(self._fd, [row], self._offset(b, r0 + i, c0)) != row.nbytes:
                    raise OSError(f"{self.path}: short read at row {r0 + i}")
        return buf.permute(0, 3, 1, 2)

    def write(self, rows: slice, cols: slice, value: Tensor) -> None:
        """Store ``value [B, C, h, w]`` at the window (converted to the map's dtype)."""
        r0, r1, c0, c1 = self._span(rows, cols)
        if value.numel() == 0:
            return
        raw = value.to(self.dtype).permute(0, 2, 3, 1).contiguous().view(torch.uint8).numpy()
        for b in range(self.shape[0]):
            for i in range(r1 - r0):
                data = memoryview(raw[b, i]).cast("B")
                off = self._offset(b, r0 + i, c0)
                while data:  # pwrite may write less (a full disk raises ENOSPC)
                    try:
                        n = os.pwrite(self._fd, data, off)
                    except OSError as exc:
                        raise self._named(exc) from exc
                    data, off = data[n:], off + n

    def close(self) -> None:
        """Close and remove the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)
