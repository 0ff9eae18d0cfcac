"""Which cluster a command joins (``cluster.connect.find_cluster``), without Ray running: ``--address``,
then RAY_ADDRESS, then the address file a running ``ray start --head`` wrote, in Ray's default temp dir
(where ``ray.init()`` looks) or in the ``--temp-dir`` that RAY_TMPDIR names (docs/operations.md's shared
host); none: a local cluster is started. And which one Ray's command line reaches by itself
(``cluster.connect.cli_cluster``): RAY_ADDRESS, Ray's default temp dir's address file, the one cluster on
the host."""

from __future__ import annotations

import ray

from rayconv.cluster import host
from rayconv.cluster.connect import address_files, cli_cluster, find_cluster


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


def test_the_cluster_rays_command_line_finds_by_itself(monkeypatch, tmp_path):
    _clean(monkeypatch, tmp_path)
    running = {"10.0.0.5:6379"}
    monkeypatch.setattr(host, "gcs_addresses", lambda: set(running))   # (this host's process table, given)
    assert cli_cluster() == "10.0.0.5:6379"              # the one cluster running here
    running.add("10.0.0.5:41234")
    assert cli_cluster() is None                         # several: Ray's command line asks for an address
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.6:6379\n")
    assert cli_cluster() == "10.0.0.6:6379"              # the last `ray start --head`'s, before those
    (tmp_path / "ray_current_cluster").write_text("10.0.0.8:6379")   # (not Ray's default temp dir: unread)
    assert cli_cluster() == "10.0.0.6:6379"
    monkeypatch.setenv("RAY_ADDRESS", "localhost:6390")  # RAY_ADDRESS first, a local host as this node's IP
    assert cli_cluster() == f"{ray.util.get_node_ip_address()}:6390"
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.5:10001")   # (Ray Client's: not a GCS address)
    assert cli_cluster() is None
