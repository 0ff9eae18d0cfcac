"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``, 2 CPUs each, told apart by custom
resources): a dp=2 x fs=2 job places ranks by node, so each filter-split group stays inside a node;
a user's ResNet-like model in a file that is not installed trains dp=2 with one actor per node (its
module shipped to both nodes in Ray's py_modules) as single-device SGD does.

With ``--out`` in a bucket of a real S3-compatible server on loopback (moto), whose endpoint and test
credentials every node's environment holds (as a cloud cluster's nodes hold theirs): an elastic run
that loses a node continues from the bucket's checkpoint to single-device SGD's parameters; a node
whose environment points elsewhere is named in one line before the first step (exit status 2).

The two-node cluster is conftest's ``two_nodes``, one for the module (no ``ray_cluster`` fixture),
started once the S3 server's environment is set."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import ray
import torch

from support.helpers import assert_same_state, reference_microbatch_sgd, reference_sgd, sgd_config
from rayconv.config import Config
from rayconv.cluster import pool
from rayconv.driver.job import train_run
from rayconv.mesh import Mesh
from tests.support.s3_server import s3_server


@pytest.fixture(scope="module")
def bucket():
    """The S3 server, its environment set in this process before the nodes start (their actors inherit
    it)."""
    with s3_server() as s3:
        yield s3


@pytest.fixture(scope="module")
def two_nodes(bucket, two_nodes):   # (conftest's, started after ``bucket``)
    return two_nodes


def add_node_b(cluster):
    """A node like the fixture's second (2 CPUs, ``node_b``), once its resources show as free (the
    scaling policy reads them)."""
    import time

    node = cluster.add_node(num_cpus=2, resources={"node_b": 1})
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 30
    while ray.available_resources().get("node_b", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    return node


# (before the ranks test: the four actors that test keeps serve the elastic test's first layout)
def test_users_model_from_a_file_trains_dp2_across_the_nodes(two_nodes, tmp_path, monkeypatch):
    """ResNetish (tests/support/fixtures/resnetish.py) copied to a folder no worker runs in, given by a
    relative path: each of the two actors (2 CPUs each, one per node) imports it from py_modules. Batch norm
    normalises each replica's share: the reference is reference_microbatch_sgd, to 1e-10."""
    (tmp_path / "mine").mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "support" / "fixtures" / "resnetish.py",
                tmp_path / "mine" / "resnetish.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "resnetish", raising=False)  # (this copy is imported as resnetish)
    try:
        _train_the_copy(tmp_path)
    finally:  # later tests import the fixture itself under that name, which the loader refuses as shadowing
        sys.modules.pop("resnetish", None)


def _train_the_copy(tmp_path) -> None:
    seen = {}
    cfg = sgd_config(tmp_path, "users", model="mine/resnetish.py:ResNetish", dp=2, steps=2, eval_every=2,
                     num_cpus_per_actor=2, loader_workers=0)
    summary = train_run(cfg, log=lambda *_: None,
                        on_step=lambda actor_group, step: seen.update(info=list(actor_group.info)))
    assert len({i["node_id"] for i in seen["info"]}) == 2, "one actor per node"
    want, test_loss = reference_microbatch_sgd(cfg, 2)
    assert_same_state(torch.load(tmp_path / "users" / "model.pt", weights_only=True), want, atol=1e-10)
    assert abs(summary["test_loss"] - test_loss) < 1e-10



@pytest.mark.slow
def test_ranks_by_node_and_fs_groups_inside_a_node(two_nodes, tmp_path):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2 and sum(r["CPU"] for r in nodes.values()) == 4
    seen = {}

    def look(actor_group, step):
        seen["info"] = list(actor_group.info)
        seen["roles"] = list(actor_group.roles)

    cfg = Config(model="convnet", data="digits", dp=2, fs=2, global_batch_size=64, steps=2, device="cpu",
                 progress=False, out=str(tmp_path / "two-nodes"), loader_workers=0).validate()
    summary = train_run(cfg, log=lambda *_: None, on_step=look)
    assert summary["layout"]["world_size"] == 4
    node_of = [i["node_id"] for i in seen["info"]]
    assert len(set(node_of)) == 2, "the job should span both nodes (2 CPUs each, 4 actors)"
    # Ranks are ordered by node: each node's ranks are contiguous (node ids non-decreasing in the order
    # of first appearance).
    order = list(dict.fromkeys(node_of))
    assert [order.index(n) for n in node_of] == sorted(order.index(n) for n in node_of)
    # Every filter-split group (the innermost, chattiest axis) is inside one node.
    for group in Mesh(2, 1, 2).groups("fs"):
        assert len({node_of[r] for r in group}) == 1, (group, node_of)
    # Each node holds one of the two custom resources it was started with.
    assert sorted(k for r in nodes.values() for k in r if k.startswith("node_")) == ["node_a", "node_b"]


@pytest.mark.slow
def test_elastic_dp4_shrinks_grows_and_loses_no_step(two_nodes, tmp_path, monkeypatch):
    """--dp 4 --elastic 2 --checkpoint-every 2 over the two nodes (two actors each), 10 steps: the second
    node is removed after step 2, so the run continues on dp2 from the checkpoint of step 2; an actor's
    SIGTERM after step 3 makes the run write the checkpoint of step 5 and continue from it (no step
    lost); a node is added after step 5, and at the checkpoint of step 6 the run is dp4 again; that node
    is drained (``ray drain-node``'s GCS call, reason preemption) after step 6: at the next step
    boundary, the checkpoint of step 8, the run goes on dp2 (no step lost); an actor killed after the
    last step (its checkpoint written, the final export to come) is replaced and the export done from
    the checkpoint of step 10. The final weights are
    single-device SGD's (float64, 1e-10): every layout computes the same steps, so they are also the
    uninterrupted run's. Each change is a console line, a summary row and the metrics' layout."""
    import os
    import signal
    import time

    import pyarrow.parquet as pq
    from ray.core.generated import autoscaler_pb2

    from rayconv.cluster.nodes import draining_nodes
    from rayconv.driver import elastic

    monkeypatch.setattr(elastic, "DRAIN_POLL_S", 0.0)   # (a look at the draining nodes after every step)
    done: dict[str, object] = {}

    def add_node():
        return add_node_b(two_nodes)

    def events(actor_group, step):
        if step == 2 and "removed" not in done:
            done["removed"] = True
            two_nodes.remove_node(next(iter(two_nodes.worker_nodes)))
        elif step == 3 and "sigterm" not in done:
            done["sigterm"] = True
            os.kill(actor_group.info[1]["pid"], signal.SIGTERM)
        elif step == 5 and "added" not in done:
            done["added"] = add_node()
        elif step == 6 and "drained" not in done:
            gcs = ray._raylet.GcsClient(address=two_nodes.address)
            accepted, why = gcs.drain_node(done["added"].node_id, autoscaler_pb2.DrainNodeReason.Value(
                "DRAIN_NODE_REASON_PREEMPTION"), "spot notice", 0)
            assert accepted, why
            deadline = time.monotonic() + 30   # (until the cluster's status shows it, as the driver reads it)
            while done["added"].node_id not in draining_nodes() and time.monotonic() < deadline:
                time.sleep(0.05)
            done["drained"] = True
        # after the last step's checkpoint: the export finds it dead
        elif step == 9 and "export" not in done:
            done["export"] = True
            os.kill(actor_group.info[0]["pid"], signal.SIGKILL)

    lines: list[str] = []
    cfg = sgd_config(tmp_path, "elastic", dp=4, steps=10, eval_every=10, checkpoint_every=2, elastic=2,
                     elastic_wait=1.0, max_failures=2, collective_timeout_s=30, loader_workers=0)
    try:
        summary = train_run(cfg, log=lines.append, on_step=events)
    finally:   # the cluster as the fixture made it: the head node and one of node_b
        if "added" in done:
            two_nodes.remove_node(done["added"])
            add_node()
    assert set(done) == {"removed", "sigterm", "added", "drained", "export"}
    changes = [(c["step"], c["from"], c["to"], c["steps_redone"]) for c in summary["layout_changes"]]
    assert changes == [(2, "dp4", "dp2", 1), (5, "dp2", "dp2", 0), (6, "dp2", "dp4", 0), (8, "dp4", "dp2", 0),
                       (10, "dp2", "dp2", 0)], \
        summary["layout_changes"]
    whys = [c["why"] for c in summary["layout_changes"]]
    assert "was lost" in whys[0] and whys[1] == "actor dp1 got SIGTERM" and whys[2] == "devices came back"
    assert whys[3].endswith("is draining") and "dp0 (rank 0) was lost" in whys[4]
    assert all(c["seconds_lost"] > 0 for c in summary["layout_changes"])
    # where the seconds went: each phase done, in order, the last the step
    for c in summary["layout_changes"]:
        times = list(c["phases"].values())
        assert times == sorted(times) and c["phases"]["first_step"] == c["seconds_lost"], c
        assert {"devices_free", "actors_alive", "actors_set_up"} <= set(c["phases"]), c
    said = [x for x in lines if x.startswith("rayconv: step ") and "-> " in x]
    assert len(said) == 5 and said[0].startswith("rayconv: step 2: layout dp4 -> dp2 (actor "), said
    assert summary["layout"]["dp"] == 2 and summary["failures_recovered"] == 2
    rows = [r for r in pq.read_table(tmp_path / "elastic" / "metrics.parquet").to_pylist()
            if r["kind"] == "train"]
    assert [(r["step"], r["layout"]) for r in rows] == [(k, "dp4" if k in (0, 1, 6, 7) else "dp2")
                                                        for k in range(10)]
    assert_same_state(torch.load(tmp_path / "elastic" / "model.pt", weights_only=True),
                      reference_sgd(cfg, 10), atol=1e-10)


@pytest.mark.slow
def test_elastic_checkpoints_in_a_bucket(two_nodes, bucket, tmp_path):
    """--out in the bucket, --dp 4 --elastic 2 --checkpoint-every 2 over the two nodes, 4 steps: the
    second node is removed after step 2; the run continues on dp2 from the bucket's newest complete
    checkpoint (step 2's, which the actors of both nodes wrote there) and ends at single-device SGD's
    parameters (float64, 1e-10); its checkpoints and results are in the bucket, nothing on the disk."""
    import io

    import pyarrow.parquet as pq

    from rayconv.outputs.checkpoint import list_checkpoints
    from rayconv.storage import locate

    pool.release()   # (the CPUs that actors kept by the module's earlier runs hold)
    uri = bucket.uri("multinode", "elastic")
    done: dict[str, object] = {}

    def events(actor_group, step):
        if step == 2 and "removed" not in done:
            done["removed"] = [p.name for p in list_checkpoints(uri)]
            two_nodes.remove_node(next(iter(two_nodes.worker_nodes)))

    lines: list[str] = []
    cfg = sgd_config(tmp_path, "unused", dp=4, steps=4, eval_every=4, checkpoint_every=2, elastic=2,
                     elastic_wait=1.0, max_failures=1, collective_timeout_s=30, loader_workers=0,
                     keep_checkpoints=0, out=uri)
    try:
        summary = train_run(cfg, log=lines.append, on_step=events)
    finally:   # the cluster as the fixture made it
        if "removed" in done:
            add_node_b(two_nodes)
    assert done["removed"] == ["step-2"]
    changes = [(c["step"], c["from"], c["to"], c["steps_redone"]) for c in summary["layout_changes"]]
    assert changes == [(2, "dp4", "dp2", 1)], summary["layout_changes"]
    assert any(f"continuing from {uri}/checkpoints/step-2" in x for x in lines), lines
    out = locate(uri)
    assert [p.name for p in list_checkpoints(out)] == ["step-2", "step-4"]
    rows = [r for r in pq.read_table(io.BytesIO((out / "metrics.parquet").read_bytes())).to_pylist()
            if r["kind"] == "train"]
    assert [(r["step"], r["layout"]) for r in rows] == [(k, "dp4" if k < 2 else "dp2") for k in range(4)]
    model = torch.load(io.BytesIO((out / "model.pt").read_bytes()), weights_only=True)
    assert_same_state(model, reference_sgd(cfg, 4), atol=1e-10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_node_that_cannot_write_the_bucket_is_named_before_the_first_step(two_nodes, bucket, tmp_path,
                                                                             monkeypatch, capsys):
    """A third node whose environment sends its actors to an endpoint where nothing listens, while the
    driver's reaches the bucket: a dp3 run (one actor a node) with checkpoints into the bucket stops
    before its first step with one line naming that node and what to change, exit status 2, nothing
    written (in the bucket or on the disk)."""
    from rayconv.run import main
    from rayconv.storage import locate
    from tests.support.ray_head import free_port

    pool.release()
    wrong = f"http://127.0.0.1:{free_port()}"
    node = two_nodes.add_node(num_cpus=2, resources={"node_c": 1}, env_vars={"AWS_ENDPOINT_URL": wrong})
    two_nodes.wait_for_nodes()
    uri = bucket.uri("multinode", "refused")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["--model", "convnet", "--data", "digits", "--dp", "3", "--num-cpus-per-actor", "2",
                   "--global-batch-size", "96", "--steps", "2", "--checkpoint-every", "1", "--device", "cpu",
                   "--no-progress", "--loader-workers", "0", "--keep-actors-s", "0", "--out", uri])
    finally:
        two_nodes.remove_node(node)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"rayconv: error: checkpoints to {uri}: the actors on node " in err, err
    assert f"({node.node_id[:8]}) cannot write there, though the driver can" in err, err
    assert f"cannot reach the storage endpoint {wrong[len('http://'):]}" in err, err
    assert "AWS_* variables in the environment of each node's ray start" in err, err
    assert err.endswith("nothing was written"), err
    assert not locate(uri).exists()
    assert list(tmp_path.iterdir()) == []

