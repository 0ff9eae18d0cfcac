"""An S3-compatible server on loopback for the tests: moto's standalone server
(``moto.server.ThreadedMotoServer``) on a free port, in a process of its own, with a bucket made, and the
environment a client of it needs (``AWS_ENDPOINT_URL``, test keys, a region). Nothing of pyarrow or Ray is
mocked: rayconv talks to it over HTTP through ``pyarrow.fs.S3FileSystem`` as it would to a cloud bucket.

The server has its own process (as a store has its own machine) so that its answers never wait on the
test process: a driver that runs in the test process (``rayconv.run.main``) holds the interpreter lock
for seconds at a time (imports, the float64 references), and a server thread beside it would answer
past the client's request timeout on a busy machine. The process keeps the buckets between ``stop`` and
``start`` (moto's backends live in it), and ends when the test process closes its stdin or ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional

from tests.support.ray_head import free_port

# The server's process: one command a line on stdin ("start", "stop"), "ok" on stdout once done.
_SERVE = """
import sys
from moto.server import ThreadedMotoServer
server = None
for line in sys.stdin:
    if line.strip() == "start" and server is None:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
        server.start()
    elif line.strip() == "stop" and server is not None:
        server.stop()
        server = None
    print("ok", flush=True)
"""


@dataclass
class S3Server:
    port: int
    bucket: str
    process: Optional[subprocess.Popen] = field(default=None, repr=False)   # the server's process
    answering: bool = False

    def _command(self, word: str) -> None:
        if self.process is None:
            self.process = subprocess.Popen([sys.executable, "-c", _SERVE, str(self.port)], text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()
        if self.process.stdout.readline().strip() != "ok":
            raise RuntimeError(f"moto's server process did not {word} (exit status {self.process.poll()})")

    def stop(self) -> None:
        """Stop answering (connections refused; the buckets' contents stay in the server's process:
        ``start`` serves them again)."""
        if self.answering:
            self._command("stop")
            self.answering = False

    def start(self) -> None:
        if not self.answering:
            self._command("start")
            self.answering = True

    def check_credentials(self, on: bool) -> None:
        """Whether the server checks every request's credentials (moto's own API, ``/moto-api/reset-auth``:
        the count of requests it lets through unchecked, 0 or unbounded)."""
        import urllib.request
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", method="POST",
                                         data=b"0" if on else b"inf", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200

    def end(self) -> None:
        """End the server's process (its buckets with it)."""
        if self.process is not None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process, self.answering = None, False

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
    saved = {k: os.environ.get(k) for k in s3.env}
    try:
        s3.start()
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
        s3.end()


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
