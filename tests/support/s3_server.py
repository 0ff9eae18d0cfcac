"""An S3-compatible server on loopback for the tests: moto's standalone server
(``moto.server.ThreadedMotoServer``) on a free port, with a bucket made, and the environment a client of
it needs (``AWS_ENDPOINT_URL``, test keys, a region). Nothing of pyarrow or Ray is mocked: rayconv talks
to it over HTTP through ``pyarrow.fs.S3FileSystem`` as it would to a cloud bucket."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from tests.support.ray_head import free_port


@dataclass
class S3Server:
    port: int
    bucket: str
    server: Optional[Any] = field(default=None, repr=False)   # the running ThreadedMotoServer, or None

    def stop(self) -> None:
        """Stop answering (the buckets' contents stay in this process: ``start`` serves them again)."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer
        if self.server is None:
            self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process (a driver, a Ray node) needs to reach the server with test credentials."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def uri(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *parts])

    def filesystem(self):
        import pyarrow.fs as pafs
        return pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http",
                                 access_key="testing", secret_key="testing", region="us-east-1",
                                 allow_bucket_creation=True, allow_bucket_deletion=True)


@contextlib.contextmanager
def s3_server(bucket: str = "rayconv-test", set_env: bool = True) -> Iterator[S3Server]:
    """Start the server with ``bucket`` made; with ``set_env`` the client environment is set in this
    process (and restored after)."""
    s3 = S3Server(free_port(), bucket)
    s3.start()
    saved = {k: os.environ.get(k) for k in s3.env}
    try:
        if set_env:
            os.environ.update(s3.env)
        s3.filesystem().create_dir(bucket)
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3.stop()


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
