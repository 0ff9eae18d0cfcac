"""The checks a run makes of its storage before it starts: that ``--out`` (or another output flag) can be
written, that a ``--resume``/``--init``/``--data-dir`` location can be read (by the driver, before Ray
starts), and that each node holding actors that will write checkpoints into a store can write there
(``node_can_write``, run on one actor per node before the first step). On the local disk nothing is
made; in a store a small probe object is written and deleted. Each failure is one ``StorageError`` line
(``storage.one_line``): wrong credentials, a missing bucket, an unreachable endpoint, a place that
cannot be written."""

from __future__ import annotations

import os
import secrets as _random
import tempfile
from typing import Optional

from rayconv.storage import Location, StorageError, locate, storage_errors, why_not


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


def node_can_write(uri: str) -> Optional[str]:
    """Whether this process (an actor, with its node's environment: credentials, ``AWS_ENDPOINT_URL``)
    can write into the store's folder ``uri``: a small probe object written directly under it and
    deleted. Returns None when it can, else why not (one line, without the URI: ``storage.why_not``).
    No folder is removed, since other nodes probe the same folder at the same time (pyarrow may leave
    the folder's marker object: the run writes there next, or removes the folder it made)."""
    try:
        loc = locate(uri)
    except StorageError as e:   # (this node's pyarrow cannot open such a URI)
        return str(e)
    probe = loc / f".rayconv-probe-{_random.token_hex(6)}"
    try:
        with probe.fs.open_output_stream(probe.path) as f:
            f.write(b"")
        probe.fs.delete_file(probe.path)
    except (OSError, ValueError) as e:   # (pyarrow's errors: ArrowIOError, ArrowInvalid)
        return why_not(e, loc)
    return None
