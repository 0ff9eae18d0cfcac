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

import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayconv.errors import ConfigError

# Query parameters of pyarrow's S3/GCS URIs that hold a secret (pyarrow.fs.S3FileSystem, GcsFileSystem).
SECRET_PARAMS = frozenset({"access_key", "secret_key", "session_token", "access_token", "credentials",
                           "password"})
REMOTE_SCHEMES = frozenset({"s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss"})


class StorageError(ConfigError):
    """A location cannot be used: a bad or secret-carrying URI, wrong credentials, a missing bucket, an
    unreachable endpoint, a place that cannot be written."""


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
        raise StorageError(
            f"{flag}: the URI carries a secret ({', '.join(sorted(keys & SECRET_PARAMS)) or 'user:password'}); "
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

    def mkdir(self) -> None:
        self.fs.create_dir(self.path, recursive=True)

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def write_bytes(self, data: bytes) -> None:
        """Write the whole object or nothing: a local file through a temporary name and a rename, an
        object by one PUT."""
        if self.local is not None:
            from rayconv.files import atomic_write
            self.local.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.local, lambda tmp: Path(tmp).write_bytes(data))
            return
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)

    def delete(self) -> None:
        """Remove this file or folder (and what it holds); nothing when it does not exist."""
        import pyarrow.fs as pafs
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type != pafs.FileType.NotFound:
            self.fs.delete_file(self.path)


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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"{flag} {s}: cannot be opened ({first}); give a local path or a URI such as "
                           "s3://bucket/prefix, gs://bucket/prefix or file:///abs/path") from None
    return Location(s, fs, path)
