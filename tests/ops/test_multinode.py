"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``, 2 CPUs each, told apart by custom
resources): a dp=2 x fs=2 job places ranks by node, so each filter-split group stays inside a node;
a user's ResNet-like model in a file that is not installed trains dp=2 with one actor per node (its
module shipped to both nodes in Ray's py_modules) as single-device SGD does.

The two-node cluster is conftest's ``two_nodes`` (shared with tests/ops/test_local_copy.py's two-node test; no
``ray_cluster`` fixture)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import ray
import torch

from support.helpers import assert_same_state, reference_microbatch_sgd, sgd_config
from rayconv.config import Config
from rayconv.driver.job import train_run
from rayconv.mesh import Mesh

pytestmark = pytest.mark.own_cluster  # (conftest runs such modules last)


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


def test_users_model_from_a_file_trains_dp2_across_the_nodes(two_nodes, tmp_path, monkeypatch):
    """ResNetish (tests/support/fixtures/resnetish.py) copied to a folder no worker runs in, given by a relative
    path: each of the two actors (2 CPUs each, one per node) imports it from py_modules. Batch norm
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
    summary = train_run(cfg, log=lambda *_: None, on_step=lambda actor_group, step: seen.update(info=list(actor_group.info)))
    assert len({i["node_id"] for i in seen["info"]}) == 2, "one actor per node"
    want, test_loss = reference_microbatch_sgd(cfg, 2)
    assert_same_state(torch.load(tmp_path / "users" / "model.pt", weights_only=True), want, atol=1e-10)
    assert abs(summary["test_loss"] - test_loss) < 1e-10
