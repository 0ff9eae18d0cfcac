"""The ``ray list actors`` command the reuse line prints for kept actors names the cluster (as RAY_ADDRESS,
which Ray's state commands take before their ``--address``) where Ray's command line, searching by itself
(RAY_ADDRESS, Ray's address file, the one Ray running on the host), would not reach the cluster this run
is attached to (``cluster.connect.cli_address``); the cluster this process started is found on the host's
process table as its own (``cluster.host``), and the header says so."""

from __future__ import annotations

import os

import ray

from rayconv.cluster import host
from rayconv.cluster.connect import cli_address, cluster_origin, started_here
from rayconv.driver.progress import kept_names


def test_the_list_command_names_the_cluster_where_ray_would_find_another(ray_cluster, monkeypatch):
    gcs = ray.get_runtime_context().gcs_address
    names = ["rayconv/r0-7c1d2e/dp0", "rayconv/r0-7c1d2e/dp1"]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")   # (another cluster: Ray's command line goes there)
    assert cli_address() == gcs
    assert f'(`RAY_ADDRESS={gcs} ray list actors --filter "name=rayconv/r0-7c1d2e/dp0"`)' in \
        kept_names(names, "r1-3f9a2c")
    monkeypatch.setenv("RAY_ADDRESS", gcs)   # (Ray's command line finds this one by itself)
    assert cli_address() is None
    assert kept_names(names, "r1-3f9a2c").endswith(
        '(`ray list actors --filter "name=rayconv/r0-7c1d2e/dp0"`)')
    assert kept_names(names, "r0-7c1d2e") == ""   # (the run's own names: nothing to add)


def test_the_cluster_this_process_started_is_found_on_the_host(ray_cluster):
    gcs = ray.get_runtime_context().gcs_address
    assert gcs in host.gcs_addresses()
    assert host.started_by(os.getpid(), gcs) and not host.started_by(os.getppid(), gcs)
    assert started_here()   # (ray.init of this process, not rayconv's connect, started it)
    origin = cluster_origin()   # (the second form once a connect of this process reused it: other modules)
    assert origin.startswith((f"started a local cluster at {gcs} (",
                              f"reusing the local cluster this process started at {gcs} (")), origin
