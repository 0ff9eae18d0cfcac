"""Where rayconv reads and writes: a local path or any URI that ``pyarrow.fs.FileSystem.from_uri`` takes
(``s3://bucket/prefix``, ``gs://bucket/prefix``, ``hdfs://...``, ``file:///abs/path``).

A ``Location`` is one place in one file system. Credentials come from the storage's own chain (for S3:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance roles;
the endpoint from ``AWS_ENDPOINT_URL`` or the URI's ``endpoint_override``), never from the URI: a URI
that carries a secret is refused (``StorageError``), so that no secret reaches ``config.json``, a
manifest, the console or the dashboard. A ``Location`` pickles as its URI and is resolved again where it
is unpickled (an actor on another node uses that node's credentials).

Writes are whole or absent: a local file is written to a temporary name and renamed
(``files.atomic_write``); an object store's PUT of one object is atomic by itself. A folder of several
files (a checkpoint) is complete only once its manifest, written last, exists.

Errors: ``StorageError`` (a ``ConfigError``: exit status 2), one line naming the flag and what to change.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from rayconv.errors import ConfigError, first_line

# Query parameters of pyarrow's S3/GCS URIs that hold a secret (pyarrow.fs.S3FileSystem, GcsFileSystem).
SECRET_PARAMS = frozenset({"access_key", "secret_key", "session_token", "access_token", "credentials",
                           "password"})
REMOTE_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})


class StorageError(ConfigError):
    """A location cannot be used: a bad or secret-carrying URI, wrong credentials, a missing bucket, an
    unreachable endpoint, a place that cannot be written."""


class StoreWriteFailed(StorageError, OSError):
    """A write to an object store failed (``Location.write_bytes``/``upload``): one line saying why
    (``one_line``); an OSError too, for callers that retry or report I/O errors."""


def is_uri(where: str | os.PathLike) -> bool:
    """Whether ``where`` names a file system by scheme (``s3://...``, ``file://...``), not a plain path."""
    s = os.fspath(where)
    scheme = urllib.parse.urlsplit(s).scheme
    return "://" in s and len(scheme) > 1


def is_remote(where: str | os.PathLike) -> bool:
    """Whether ``where`` is an object store or a distributed file system (not this node's disk)."""
    return is_uri(where) and urllib.parse.urlsplit(os.fspath(where)).scheme.lower() in REMOTE_SCHEMES


def _refuse_secrets(uri: str, flag: str) -> None:
    parts = urllib.parse.urlsplit(uri)
    keys = {k.lower() for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)}
    if parts.password is not None or keys & SECRET_PARAMS:
        what = ", ".join(sorted(keys & SECRET_PARAMS)) or "user:password"
        raise StorageError(
            f"{flag}: the URI carries a secret ({what}); "
            "give credentials through the storage's own chain (for S3: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role), not in the URI")


def _endpoint_from_env(uri: str) -> str:
    """An S3 URI with ``endpoint_override`` (and its scheme) taken from ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL`` when the URI names none (as the AWS SDKs and CLI read them)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme.lower() != "s3":
        return uri
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if "endpoint_override" in query or not endpoint:
        return uri
    ep = urllib.parse.urlsplit(endpoint)
    query["endpoint_override"] = ep.netloc or ep.path
    if ep.scheme and "scheme" not in query:
        query["scheme"] = ep.scheme
    if "region" not in query and os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION")):
        query["region"] = os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION"))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


@dataclass(frozen=True)
class Location:
    """One place in one file system: ``uri`` as the user gave it (no secret in it), the file system and
    the path inside it. ``/`` joins a name; ``local`` is the ``Path`` on this node's disk, or None."""

    uri: str
    fs: Any = field(repr=False, compare=False)   # pyarrow.fs.FileSystem
    path: str = ""

    def __reduce__(self):
        return (_relocate, (self.uri,))

    def __str__(self) -> str:
        return self.uri

    def __truediv__(self, name: str) -> "Location":
        name = str(name).strip("/")
        uri = self.uri.rstrip("/") + "/" + name if not _has_query(self.uri) else _join_uri(self.uri, name)
        return Location(uri, self.fs, f"{self.path.rstrip('/')}/{name}" if self.path else name)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def local(self) -> Optional[Path]:
        import pyarrow.fs as pafs
        return Path(self.path) if isinstance(self.fs, pafs.LocalFileSystem) else None

    @property
    def remote(self) -> bool:
        return self.local is None

    @property
    def relative(self) -> bool:
        """Whether it was given as a plain relative path (made absolute against this process's folder)."""
        return not is_uri(self.uri) and not Path(self.uri).expanduser().is_absolute()

    def exists(self) -> bool:
        import pyarrow.fs as pafs
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs
        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def listdir(self) -> list[str]:
        """Names directly under this location (empty when it does not exist)."""
        import pyarrow.fs as pafs
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted(i.base_name for i in infos)

    def is_file(self) -> bool:
        import pyarrow.fs as pafs
        return self.fs.get_file_info(self.path).type == pafs.FileType.File

    def iterdir(self) -> list["Location"]:
        """What lies directly under this location, as Locations (as ``Path.iterdir``)."""
        return [self / name for name in self.listdir()]

    @property
    def parent(self) -> "Location":
        parts = urllib.parse.urlsplit(self.uri)
        path = parts.path.rstrip("/").rsplit("/", 1)[0]
        uri = urllib.parse.urlunsplit(parts._replace(path=path)) if path else \
            urllib.parse.urlunsplit(parts._replace(path=""))
        return Location(uri, self.fs, self.path.rstrip("/").rsplit("/", 1)[0])

    def absolute(self) -> "Location":
        return self

    resolve = absolute

    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        """Make the folder (an object store's prefix needs none: nothing is written there)."""
        if self.local is not None:
            self.local.mkdir(parents=parents, exist_ok=exist_ok)

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def write_with(self, write: Callable[[str], None]) -> None:
        """Whole or absent: ``write(tmp_path)`` writes a local file, which then replaces this one
        (a rename on the local disk; one upload to an object store, visible only once complete)."""
        if self.local is not None:
            from rayconv.files import atomic_write
            atomic_write(self.local, write)
            return
        with tempfile.TemporaryDirectory(prefix="rayconv-upload-") as tmp:
            f = os.path.join(tmp, self.name or "object")
            write(f)
            self.upload(f)

    def upload(self, local_file: str | os.PathLike) -> None:
        """This object <- the local file, streamed (an S3 multipart upload is visible only once
        complete; on an error it is aborted, so nothing half-written appears)."""
        with _writing(self):
            stream = self.fs.open_output_stream(self.path)
            try:
                with open(local_file, "rb") as src:
                    shutil.copyfileobj(src, stream, 8 << 20)
            except BaseException:
                if hasattr(stream, "abort"):   # (pyarrow >= 16: drop the upload instead of completing it)
                    stream.abort()
                raise
            stream.close()

    def write_bytes(self, data: bytes) -> None:
        """Write the whole object or nothing: a local file through a temporary name and a rename, an
        object by one PUT."""
        if self.local is not None:
            from rayconv.files import atomic_write
            self.local.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.local, lambda tmp: Path(tmp).write_bytes(data))
            return
        with _writing(self):
            stream = self.fs.open_output_stream(self.path)
            try:
                stream.write(data)
            except BaseException:
                if hasattr(stream, "abort"):
                    stream.abort()
                raise
            stream.close()

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok or self.exists():
            self.delete()
        else:
            raise FileNotFoundError(self.uri)

    def delete(self) -> None:
        """Remove this file or folder (and what it holds); nothing when it does not exist."""
        import pyarrow.fs as pafs
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type != pafs.FileType.NotFound:
            self.fs.delete_file(self.path)


@contextlib.contextmanager
def _writing(loc: "Location") -> Iterator[None]:
    """An OSError of a store's write as ``StoreWriteFailed`` (one line, naming the object)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        err = one_line(e, loc, "writing", "failed")
        raise StoreWriteFailed(str(err)) from None


def _has_query(uri: str) -> bool:
    return bool(urllib.parse.urlsplit(uri).query)


def _join_uri(uri: str, name: str) -> str:
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + name))


def _relocate(uri: str) -> Location:
    return locate(uri)


def locate(where: str | os.PathLike, *, flag: str = "path") -> Location:
    """The ``Location`` that ``where`` (a plain path or a URI) names. Raises StorageError (one line,
    naming ``flag``) for a URI that carries a secret or that pyarrow cannot resolve (an unknown scheme, a
    file system this pyarrow was built without)."""
    s = os.fspath(where)
    if not is_uri(s):
        import pyarrow.fs as pafs
        return Location(s, pafs.LocalFileSystem(), str(Path(s).expanduser().absolute()))
    _refuse_secrets(s, flag)
    import pyarrow.fs as pafs
    try:
        fs, path = pafs.FileSystem.from_uri(_endpoint_from_env(s))
    except (ValueError, OSError, NotImplementedError) as e:  # pyarrow: ArrowInvalid, ArrowIOError, ...
        first = first_line(e)
        if any(k in str(e) for k in UNREACHABLE):   # (pyarrow asks the store for an S3 bucket's region)
            raise StorageError(f"{flag} {s}: cannot reach the storage to open it ({first}): check the "
                               "network and AWS_ENDPOINT_URL, or give the region in the URI "
                               "(s3://bucket/prefix?region=REGION), which skips the lookup") from None
        raise StorageError(f"{flag} {s}: cannot be opened ({first}); give a local path or a URI such as "
                           "s3://bucket/prefix, gs://bucket/prefix or file:///abs/path") from None
    return Location(s, fs, path)


# ---------------------------------------------------------------------- where a run writes
Place = Union[Path, Location]   # a run's folder: a Path on this node's disk, else a Location


def place(where: str | os.PathLike | Location, *, flag: str = "path") -> Place:
    """Where ``where`` names, as the code that writes there takes it: a ``Path`` for a plain path or a
    ``file://`` URI (this node's disk, written as ever), a ``Location`` for any other file system (an
    object store: ``Location`` has ``Path``'s methods that rayconv's writers use, and is no
    ``os.PathLike``, so that ``open()`` or ``Path()`` of it fails instead of making a local folder
    named ``s3:``). Raises StorageError as ``locate``."""
    loc = where if isinstance(where, Location) else locate(where, flag=flag)
    return loc.local if loc.local is not None else loc


def remove(p: Place) -> None:
    """Delete a file or folder (and what it holds) on the disk or in a store; nothing if absent."""
    if isinstance(p, Location):
        p.delete()
    elif p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def copy_tree(src: Place, dst: Place) -> None:
    """Copy the folder ``src`` (and what it holds) to ``dst``, each on the disk or in a store
    (``pyarrow.fs.copy_files``: streamed, server-side within one store where it can)."""
    import pyarrow.fs as pafs
    s, d = (p if isinstance(p, Location) else locate(p) for p in (src, dst))
    d.fs.create_dir(d.path, recursive=True)   # (copy_files makes only the folders inside the source)
    pafs.copy_files(s.path, d.path, source_filesystem=s.fs, destination_filesystem=d.fs)


def rename(src: Place, dst: Place) -> None:
    """``src`` moved to ``dst`` in the same file system: a rename on the disk; in a store (which has
    none) a copy, then the original deleted."""
    if isinstance(src, Path):
        os.rename(src, dst)
        return
    copy_tree(src, dst)
    src.delete()


def describe(p: Place) -> str:
    """How the console and summary.json name a run's folder: a local path in full, a URI as given."""
    return str(p.absolute()) if isinstance(p, Path) else p.uri


# ---------------------------------------------------------------------- checks before a run
ACCESS_DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "AccessDenied",
                 "InvalidAccessKeyId", "SignatureDoesNotMatch", "EXPIRED_TOKEN", "Forbidden", "403")
NO_BUCKET = ("NO_SUCH_BUCKET", "NoSuchBucket", "does not exist", "not found")
UNREACHABLE = ("NETWORK_CONNECTION", "curlCode", "Could not connect", "Couldn't connect", "resolve host",
               "Connection refused", "timed out", "Timeout")


def _endpoint(loc: Location) -> str:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(_endpoint_from_env(loc.uri)).query))
    return query.get("endpoint_override") or "(the provider's default)"


def one_line(e: BaseException, loc: Location, flag: str, doing: str = "cannot be written") -> StorageError:
    """A storage error ``e`` (pyarrow's OSError, an AWS error code in its text) at ``loc`` as one line
    saying what to change: wrong credentials, a missing bucket, an unreachable endpoint, else ``doing``
    with the error's first line (``flag uri: why_not``)."""
    return StorageError(f"{flag} {loc.uri}: {why_not(e, loc, doing)}")


def why_not(e: BaseException, loc: Location, doing: str = "cannot be written") -> str:
    """``one_line``'s reason for ``e`` at ``loc``, without the flag and the URI."""
    text = str(e).strip()
    first = first_line(e)
    bucket = loc.path.split("/", 1)[0]
    if any(k in text for k in UNREACHABLE):
        why = (f"cannot reach the storage endpoint {_endpoint(loc)}: check AWS_ENDPOINT_URL (or the URI's "
               "endpoint_override) and the network")
    elif any(k in text for k in ACCESS_DENIED):
        why = ("access denied: check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
               "AWS_PROFILE or the node's role) and that they may read and write there")
    elif loc.remote and any(k in text for k in NO_BUCKET) and "bucket" in text.lower():
        why = f"the bucket {bucket} does not exist: create it, or name another"
    else:
        why = f"{doing} ({first})"
    return why


@contextlib.contextmanager
def storage_errors(loc: Location, flag: str, doing: str = "cannot be read") -> Iterator[None]:
    """For the body: an OSError from the store becomes ``one_line``'s StorageError."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        raise one_line(e, loc, flag, doing) from None
