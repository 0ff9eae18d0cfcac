"""rayconv.storage against a real S3-compatible server on loopback (moto) and the local disk."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from rayconv.driver.best import Best, load_best, write_best
from rayconv.errors import CheckpointError
from rayconv.files import atomic_write, write_json
from rayconv.outputs.checkpoint import list_checkpoints, load_checkpoint, remove_partial, write_checkpoint
from rayconv.outputs.tensorboard import EventFiles
from rayconv.storage import StorageError, copy_tree, is_remote, locate, place, rename
from tests.support.s3_server import s3_server


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def test_write_read_list_delete_in_a_bucket(s3):
    loc = locate(s3.uri("storage-unit", "r1"), flag="--out")
    assert loc.remote and is_remote(loc.uri)
    (loc / "a.json").write_bytes(b"{}")
    assert (loc / "a.json").read_bytes() == b"{}" and loc.listdir() == ["a.json"]
    again = pickle.loads(pickle.dumps(loc / "a.json"))  # an actor resolves the URI again
    assert again.read_bytes() == b"{}" and again.uri == s3.uri("storage-unit", "r1", "a.json")
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


def test_a_uri_is_never_a_local_path(s3, tmp_path, monkeypatch):
    """A store's place is no os.PathLike: open() or Path() of it fails instead of making a local folder
    named s3:; a plain path and a file:// URI are this disk's Path."""
    monkeypatch.chdir(tmp_path)
    out = place(s3.uri("storage-unit", "r9"), flag="--out")
    with pytest.raises(TypeError):
        Path(out)
    with pytest.raises(TypeError):
        open(out / "x", "wb")
    assert place(f"file://{tmp_path}/a") == tmp_path / "a" and place("b") == tmp_path / "b"
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_in_a_bucket_are_complete_only_with_their_manifest(s3):
    out = place(s3.uri("storage-unit", "ck"))
    meta = {"model": "m", "layout": {"dp": 1, "pp": 1, "fs": 1}}
    write_checkpoint(out, 2, [b"rank0"], meta, extra={"metrics.parquet": b"rows"})
    write_checkpoint(out, 4, [b"rank0-4"], meta)
    (out / "checkpoints" / "step-6" / "rank-0.pt").write_bytes(b"half")   # an upload cut short
    assert [p.name for p in list_checkpoints(out)] == ["step-2", "step-4"]
    ckpt = load_checkpoint(s3.uri("storage-unit", "ck"))   # the newest complete, read from the URI
    assert ckpt.step == 4 and ckpt.rank_file(0) == b"rank0-4" and ckpt.run_dir == out
    older = load_checkpoint(f"{s3.uri('storage-unit', 'ck')}/checkpoints/step-2")
    assert older.files["metrics.parquet"] == b"rows"
    remove_partial(out)
    assert (out / "checkpoints").listdir() == ["step-2", "step-4"]
    write_checkpoint(out, 6, [b"x"], meta, keep=1)
    assert [p.name for p in list_checkpoints(out)] == ["step-6"]
    (out / "checkpoints" / "step-6" / "rank-0.pt").write_bytes(b"y")   # damaged after the manifest
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(s3.uri("storage-unit", "ck"))


def test_results_in_a_bucket_are_whole(s3):
    out = place(s3.uri("storage-unit", "res"))
    write_json(out / "summary.json", {"a": 1})
    atomic_write(out / "model.pt", lambda tmp: Path(tmp).write_bytes(b"weights"))
    with pytest.raises(ZeroDivisionError):   # a writer that fails leaves nothing
        atomic_write(out / "metrics.parquet", lambda tmp: (Path(tmp).write_bytes(b"half"), 1 / 0))
    assert out.listdir() == ["model.pt", "summary.json"] and (out / "model.pt").read_bytes() == b"weights"
    write_best(out, 3, 0.5, lambda p: p.write_bytes(b"best 3"))
    write_best(out, 7, 0.75, lambda p: p.write_bytes(b"best 7"))
    assert load_best(out) == Best(7, 0.75) and (out / "best" / "model.pt").read_bytes() == b"best 7"
    assert "best.tmp" not in out.listdir()
    copy_tree(out / "best", out / "copy")
    rename(out / "copy", out / "moved")
    assert (out / "moved").listdir() == ["best.json", "model.pt"] and "copy" not in out.listdir()


def test_event_files_reach_the_bucket_at_each_flush(s3):
    pytest.importorskip("tensorboard")
    out = place(s3.uri("storage-unit", "tb"))
    unused = EventFiles(out)   # (a run stopped before its first write: no local folder made, none left)
    unused.close()
    assert unused.folder is None
    events = EventFiles(out)
    events.add_rows([{"kind": "train", "step": 0, "loss": 1.0}])
    local = events.folder
    (name,) = (out / "tensorboard").listdir()
    first = (out / "tensorboard" / name).read_bytes()
    events.add_rows([{"kind": "train", "step": 0, "loss": 1.0}, {"kind": "train", "step": 1, "loss": 0.5}])
    events.close()
    assert len((out / "tensorboard" / name).read_bytes()) > len(first) and not local.exists()


def test_a_flat_folder_is_copied_to_a_place_whose_folders_do_not_exist_yet(tmp_path):
    """(pyarrow's copy_files makes only the folders inside the source: a folder of files alone, as a
    checkpoint is, needs its destination made.)"""
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / "manifest.json").write_text("{}")
    copy_tree(tmp_path / "step-10", tmp_path / "tune" / "checkpoints" / "step-10")
    assert (tmp_path / "tune" / "checkpoints" / "step-10" / "manifest.json").read_text() == "{}"


def test_a_rank_file_is_uploaded_whole_in_parts_and_hashed_as_written(s3):
    """actor/saver.py writes to a bucket through pyarrow's output stream: the object is ``torch.save``'s
    bytes in several parts, listed with its size and sha256."""
    import hashlib
    import io

    import torch

    from rayconv.actor.saver import write_rank_file
    where = locate(s3.uri("saver-unit", "step-2")) / "rank-0.pt"
    obj = {"format": 2, "tensors": {"w": torch.arange(1_500_000, dtype=torch.float64)}}   # (12 MB)
    meta = write_rank_file(where, obj)
    data, want = where.read_bytes(), io.BytesIO()
    torch.save(obj, want)
    assert data == want.getvalue()
    assert meta == {"name": "rank-0.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
