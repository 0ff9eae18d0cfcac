"""cluster.yaml is a valid Ray 2.58 cluster-launcher config, checked offline with Ray's own validator.

``ray up`` (ray.autoscaler._private.commands._bootstrap_config) does ``prepare_config`` (merge the
provider's defaults.yaml, merge setup commands, fill per-type min/max workers) and then
``validate_config`` (jsonschema against ray/autoscaler/ray-schema.json plus cross-field checks).
The test does the same two steps and leaves out only the provider calls that need cloud access.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import jsonschema  # installed with ray[default]; validate_config needs it
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "cluster.yaml"


def load() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)


def ray_up_validate(config: dict) -> dict:
    """What `ray up` checks before it talks to the provider. Raises on an invalid config."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def head_type(config: dict) -> dict:
    return config["available_node_types"][config["head_node_type"]]


def worker_types(config: dict) -> dict:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


def test_cluster_yaml_passes_ray_validation():
    config = load()
    prepared = ray_up_validate(config)
    assert prepared["cluster_name"] == "rayconv"
    assert prepared["provider"]["type"] == "aws"
    # The config's own values survive the merge with Ray's AWS defaults.
    assert prepared["head_node_type"] == config["head_node_type"]
    assert prepared["available_node_types"].keys() == config["available_node_types"].keys()


@pytest.mark.parametrize(
    "breakage, error, match",
    [
        pytest.param(
            lambda c: c.update(setup_command=["pip install -e ~/rayconv"]),
            jsonschema.ValidationError,
            "'setup_command' was unexpected",
            id="unknown-top-level-key",
        ),
        pytest.param(
            lambda c: c.update(max_workers="2"),
            jsonschema.ValidationError,
            "'2' is not of type 'integer'",
            id="max_workers-not-int",
        ),
        pytest.param(
            lambda c: worker_types(c)[next(iter(worker_types(c)))]["resources"].update(GPU="4"),
            jsonschema.ValidationError,
            "'4' is not of type 'integer'",
            id="gpu-count-not-int",
        ),
        pytest.param(
            lambda c: worker_types(c)[next(iter(worker_types(c)))].update(min_worker=1),
            jsonschema.ValidationError,
            "'min_worker' was unexpected",
            id="unknown-node-type-key",
        ),
        pytest.param(
            lambda c: c["docker"].update(worker_run_option=["--gpus all"]),
            jsonschema.ValidationError,
            "'worker_run_option' was unexpected",
            id="unknown-docker-key",
        ),
        pytest.param(
            lambda c: c.update(head_node_type="ray.head.missing"),
            ValueError,
            "must be one of `available_node_types`",
            id="head-type-undeclared",
        ),
        pytest.param(
            lambda c: c.update(max_workers=1),
            ValueError,
            "smaller than the sum of `min_workers`",
            id="max_workers-below-min_workers",
        ),
    ],
)
def test_broken_copies_are_rejected_by_the_same_validator(breakage, error, match):
    config = load()
    ray_up_validate(config)  # the intact file passes...
    broken = copy.deepcopy(config)
    breakage(broken)
    with pytest.raises(error, match=match):  # ...and each broken copy fails, for that reason
        ray_up_validate(broken)


def test_head_dashboard_bound_to_localhost():
    config = load()
    starts = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 1, config["head_start_ray_commands"]
    args = shlex.split(starts[0].split(";")[-1])
    assert "--head" in args
    assert "--port=6379" in args
    assert "--dashboard-host=127.0.0.1" in args
    assert not any("0.0.0.0" in c for c in config["head_start_ray_commands"])
    # Workers join the head on the same GCS port.
    assert any("--address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"])


def test_gpu_worker_type_declares_gpus():
    config = load()
    gpu_workers = {k: v for k, v in worker_types(config).items() if v["resources"].get("GPU", 0) >= 1}
    assert gpu_workers, "no worker node type declares GPU resources"
    for name, node in gpu_workers.items():
        res = node["resources"]
        # Each rayconv actor reserves {"CPU": 1, "GPU": 1}.
        assert res.get("CPU", 0) >= res["GPU"], name
        assert node["node_config"]["InstanceType"]
        # rayconv reads the GPU count when it starts, so the workers are started up front.
        assert node["min_workers"] == node["max_workers"] >= 1, name
    # The head runs no actors.
    assert head_type(config)["resources"].get("GPU", 0) == 0
    assert sum(n.get("min_workers", 0) for n in worker_types(config).values()) <= config["max_workers"]


def test_setup_installs_rayconv_on_every_node():
    config = load()
    prepared = ray_up_validate(config)
    install = re.compile(r"\bpip install\b.*\brayconv\b")
    assert any(install.search(c) for c in config["setup_commands"]), config["setup_commands"]
    # prepare_config merges setup_commands into the head's and the workers' lists: both install it.
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any(install.search(c) for c in prepared[key]), (key, prepared[key])
    # The editable install points at the mount of this checkout, and "." is the repo root.
    mounts = config["file_mounts"]
    assert mounts.get("~/rayconv") == "."
    assert (ROOT / "pyproject.toml").read_text().find('name = "rayconv"') >= 0


def on_prem_variant(config: dict) -> dict:
    """Follow the comment's recipe: the uncommented ON-PREM provider, node types deleted."""
    text = CLUSTER_YAML.read_text()
    m = re.search(r"^# ON-PREM BEGIN\n(.*?)^# ON-PREM END", text, re.S | re.M)
    assert m, "the commented-out on-prem block is missing"
    block = yaml.safe_load("\n".join(line[2:] for line in m.group(1).splitlines()))
    variant = copy.deepcopy(config)
    variant["provider"] = block["provider"]
    del variant["available_node_types"], variant["head_node_type"]
    variant["max_workers"] = len(block["provider"]["worker_ips"])
    return variant


def test_commented_on_prem_block_is_valid():
    variant = on_prem_variant(load())
    assert variant["provider"]["type"] == "local"
    assert variant["provider"]["head_ip"] and variant["provider"]["worker_ips"]
    prepared = ray_up_validate(variant)
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(variant["provider"]["worker_ips"])
