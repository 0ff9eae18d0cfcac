"""Which cluster a command joins (``cluster.connect.find_cluster``), without Ray running: ``--address``,
then RAY_ADDRESS, then the address file a running ``ray start --head`` wrote, in Ray's default temp dir
(where ``ray.init()`` looks) or in the ``--temp-dir`` that RAY_TMPDIR names (docs/operations.md's shared
host); none: a local cluster is started."""

from __future__ import annotations

import ray

from rayconv.cluster.connect import address_files, find_cluster


def _clean(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))


def test_a_head_started_with_temp_dir_ray_tmpdir_is_found(monkeypatch, tmp_path):
    # `ray start --head --temp-dir $RAY_TMPDIR` writes its address there, not under $RAY_TMPDIR/ray
    _clean(monkeypatch, tmp_path)
    assert find_cluster(None) == (None, "")
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:6390\n")
    assert find_cluster(None) == ("127.0.0.1:6390", f"Ray's address file {tmp_path / 'ray_current_cluster'}")
    assert find_cluster("auto")[0] == "127.0.0.1:6390"
    # Ray's own default temp dir first (what `ray.init()` itself would join)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    assert find_cluster(None)[0] == "127.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert find_cluster(None) == ("10.0.0.5:6379", "RAY_ADDRESS")
    assert find_cluster("10.0.0.7:6379") == ("10.0.0.7:6379", "--address")


def test_the_default_temp_dir_is_rays(monkeypatch, tmp_path):
    # the first place looked at is where Ray's own `ray.init()` reads its address file
    for env in ({"RAY_TMPDIR": str(tmp_path)}, {"TMPDIR": str(tmp_path / "t")}, {}):
        for key in ("RAY_TMPDIR", "TMPDIR"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert str(address_files()[0].parent) == ray._common.utils.get_default_ray_temp_dir(), env
