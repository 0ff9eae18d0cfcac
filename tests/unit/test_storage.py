"""rayconv.storage against a real S3-compatible server on loopback (moto) and the local disk."""

from __future__ import annotations

import pickle

import pytest

from rayconv.storage import StorageError, is_remote, locate
from tests.support.s3_server import s3_server


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def test_write_read_list_delete_in_a_bucket(s3):
    loc = locate(s3.uri("runs", "r1"), flag="--out")
    assert loc.remote and is_remote(loc.uri)
    (loc / "a.json").write_bytes(b"{}")
    assert (loc / "a.json").read_bytes() == b"{}" and loc.listdir() == ["a.json"]
    again = pickle.loads(pickle.dumps(loc / "a.json"))  # an actor resolves the URI again
    assert again.read_bytes() == b"{}" and again.uri == s3.uri("runs", "r1", "a.json")
    loc.delete()
    assert not (loc / "a.json").exists()


def test_local_paths_and_file_uris_are_the_local_disk(tmp_path):
    for where in (tmp_path / "out", f"file://{tmp_path}/out"):
        loc = locate(where)
        assert loc.local == tmp_path / "out" and not loc.remote
    (locate(tmp_path / "out") / "x.bin").write_bytes(b"1")
    assert (tmp_path / "out" / "x.bin").read_bytes() == b"1"


@pytest.mark.parametrize("uri", ["s3://b/p?access_key=A&secret_key=S", "s3://user:pw@b/p"])
def test_a_uri_with_a_secret_is_refused_in_one_line(uri):
    with pytest.raises(StorageError, match=r"--out: the URI carries a secret") as e:
        locate(uri, flag="--out")
    assert "\n" not in str(e.value) and "pw" not in str(e.value) and "=S" not in str(e.value)


def test_an_unknown_scheme_is_one_line():
    with pytest.raises(StorageError, match=r"^--data-dir foo://x/y: cannot be opened") as e:
        locate("foo://x/y", flag="--data-dir")
    assert "\n" not in str(e.value)
