"""A run told to write to or resume from a bucket it cannot use stops with one line and exit status 2
before Ray starts, against a real S3-compatible server on loopback (moto): wrong credentials (the
server made to check them), a missing bucket, an unreachable endpoint, a URI that carries a secret
(refused, the secret never printed), an --out that cannot be written; nothing is made on the local
disk (no folder named ``s3:``)."""

from __future__ import annotations

import os

import pytest
import ray

from rayconv.run import main
from rayconv.storage import StorageError, locate
from rayconv.storage_checks import check_writable
from tests.support.ray_head import free_port
from tests.support.s3_server import s3_server

RUN = ["--model", "convnet", "--data", "digits", "--steps", "2", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture
def auth_checked(s3, monkeypatch):
    """The server checks every request's credentials (no request goes unchecked); this process's keys
    are ones it does not know."""
    s3.check_credentials(True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    yield
    s3.check_credentials(False)


def one_line(argv, capsys, tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    started = ray.is_initialized()
    assert main([*RUN, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert ray.is_initialized() == started   # (refused before Ray)
    assert list(tmp_path.iterdir()) == []     # nothing made here: no folder named s3:
    return err


def test_wrong_credentials(s3, auth_checked, capsys, tmp_path, monkeypatch):
    line = one_line(["--out", s3.uri("storage-errors", "r1")], capsys, tmp_path, monkeypatch)
    assert f"--out {s3.uri('storage-errors', 'r1')}: access denied: check the credentials" in line, line
    assert "wrong-secret" not in line
    line = one_line(["--resume", s3.uri("storage-errors", "r1")], capsys, tmp_path, monkeypatch)
    assert "--resume" in line and "access denied" in line, line


def test_a_missing_bucket(s3, capsys, tmp_path, monkeypatch):
    line = one_line(["--out", "s3://no-such-bucket/r1"], capsys, tmp_path, monkeypatch)
    assert line.endswith("--out s3://no-such-bucket/r1: the bucket no-such-bucket does not exist: create it, "
                         "or name another"), line
    line = one_line(["--resume", "s3://no-such-bucket/r1"], capsys, tmp_path, monkeypatch)
    assert "--resume s3://no-such-bucket/r1: the bucket no-such-bucket does not exist" in line, line


def test_nothing_to_resume_in_the_bucket(s3, capsys, tmp_path, monkeypatch):
    line = one_line(["--resume", s3.uri("storage-errors", "never")], capsys, tmp_path, monkeypatch)
    assert "nothing is stored there" in line, line


def test_an_unreachable_endpoint(s3, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")   # (nothing listens there)
    line = one_line(["--out", s3.uri("r1")], capsys, tmp_path, monkeypatch)
    assert "cannot reach the storage endpoint 127.0.0.1:" in line and "AWS_ENDPOINT_URL" in line, line


@pytest.mark.parametrize("flag", ["--out", "--resume", "--init"])
def test_a_uri_with_a_secret_is_refused(s3, flag, capsys, tmp_path, monkeypatch):
    line = one_line([flag, s3.uri("r1") + "?access_key=AKIAX&secret_key=TOPSECRET"], capsys, tmp_path,
                    monkeypatch)
    assert f"{flag}: the URI carries a secret" in line and "TOPSECRET" not in line, line


def test_an_out_that_cannot_be_written(capsys, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert main([*RUN, "--out", str(tmp_path / "file" / "run")]) == 2
    line = capsys.readouterr().err.strip()
    assert "is a file, not a folder" in line and len(line.splitlines()) == 1, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_probe_leaves_nothing_behind(s3):
    loc = check_writable(s3.uri("probes", "probed"), "--out")   # (moto's buckets are one per process)
    assert loc.listdir() == [] and locate(s3.uri("probes")).listdir() == []
    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint


def test_a_read_only_out(capsys, tmp_path, monkeypatch):
    line = one_line(["--out", "/proc/rayconv-run"], capsys, tmp_path, monkeypatch)
    assert "--out /proc/rayconv-run cannot be written (" in line and "in /proc)" in line, line


def test_a_write_that_fails_mid_run_is_one_line(s3, monkeypatch):
    """A write to the store that fails once the run is going (the endpoint gone, a token expired) is one
    line naming the object, and an OSError for whoever retries."""
    loc = locate(s3.uri("storage-errors", "mid"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(OSError) as e:
        (locate(loc.uri) / "summary.json").write_bytes(b"{}")
    assert isinstance(e.value, StorageError) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"writing {loc.uri}/summary.json: cannot reach the storage endpoint")


def test_a_nodes_probe_says_why_it_cannot_write(s3, monkeypatch):
    """What one actor on each node runs before the first step (``storage_checks.node_can_write``), here
    in this process: None where it can write (its probe object deleted), else the reason in one line."""
    from rayconv.storage_checks import node_can_write
    uri = s3.uri("probes", "node")
    assert node_can_write(uri) is None and locate(uri).listdir() == []
    assert node_can_write("s3://no-such-bucket/r1") == ("the bucket no-such-bucket does not exist: "
                                                        "create it, or name another")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    why = node_can_write(uri)
    assert why.startswith("cannot reach the storage endpoint 127.0.0.1:") and "\n" not in why, why
