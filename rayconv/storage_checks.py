"""The checks a run makes of its storage before it starts: that ``--out`` (or another output flag) can be
written, that a ``--resume``/``--init``/``--data-dir`` location can be read. On the local disk nothing is
made; in a store a small probe object is written and deleted. Each failure is one ``StorageError`` line
(``storage.one_line``): wrong credentials, a missing bucket, an unreachable endpoint, a place that
cannot be written."""

from __future__ import annotations

import os
import secrets as _random
import tempfile

from rayconv.storage import Location, StorageError, locate, storage_errors


def check_writable(where: str | os.PathLike | Location, flag: str = "--out") -> Location:
    """Check, before the run starts, that ``where`` can be written: on the local disk, that the
    nearest existing folder above it is a folder this process may write into (nothing is made); in a
    store, that the bucket exists and that a small probe object can be written under the prefix and
    deleted again. Returns the Location. Raises StorageError (one line: wrong credentials, a missing
    bucket, an unreachable endpoint, a place that cannot be written)."""
    loc = where if isinstance(where, Location) else locate(where, flag=flag)
    if loc.local is not None:   # (a temporary file made and removed in the nearest existing folder)
        p = loc.local
        while not p.exists() and p != p.parent:
            p = p.parent
        if not p.is_dir() and p != loc.local:
            raise StorageError(f"{flag} {loc.uri}: {p} is a file, not a folder: choose another place")
        if p.is_dir():
            try:
                fd, tmp = tempfile.mkstemp(prefix=".rayconv-write-check-", dir=p)
                os.close(fd)
                os.unlink(tmp)
            except OSError as e:
                raise StorageError(f"{flag} {loc.uri} cannot be written ({e.strerror or type(e).__name__} in "
                                   f"{p}): choose a folder you can write to (nothing was written)") from None
        return loc
    import pyarrow.fs as pafs
    with storage_errors(loc, flag, "cannot be written"):
        bucket = loc.path.split("/", 1)[0]
        if loc.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise StorageError(f"{flag} {loc.uri}: the bucket {bucket} does not exist: create it, or name "
                               "another")
        existed = loc.exists()
        probe = loc / f".rayconv-probe-{_random.token_hex(4)}"
        probe.write_bytes(b"")
        probe.delete()
        if not existed:   # (pyarrow keeps the emptied prefix as a marker object: nothing is left)
            loc.fs.delete_dir(loc.path)
    return loc


def check_readable(where: str | os.PathLike | Location, flag: str) -> Location:
    """Check, before the run starts, that ``where`` (a store's URI) exists and can be read; a local path
    is left to the caller's own messages. Raises StorageError (one line)."""
    loc = where if isinstance(where, Location) else locate(where, flag=flag)
    if loc.local is None:
        with storage_errors(loc, flag):
            bucket = loc.path.split("/", 1)[0]
            if not loc.exists():
                import pyarrow.fs as pafs
                if loc.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise StorageError(f"{flag} {loc.uri}: the bucket {bucket} does not exist: name another")
                hint = {"--resume": "give a run folder's or a checkpoint's URI",
                        "--init": "give a model.pt's or a run folder's URI"}.get(flag, "check the URI")
                raise StorageError(f"{flag} {loc.uri}: nothing is stored there: {hint}")
    return loc
