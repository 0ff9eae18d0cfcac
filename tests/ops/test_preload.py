"""A local cluster that rayconv starts has its workers import the actors' first modules as they start
(``cluster.connect``'s ``preload``, on machines of ``PRELOAD_MIN_CORES`` cores or more); a cluster it
connects to keeps its own settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from rayconv.actor.actor import first_imports

REPO = Path(__file__).resolve().parents[2]

# In a fresh process: the machine counted as PRELOAD_MIN_CORES cores, ``connect`` with ``wave`` (a module
# no Ray worker imports of itself) to preload, then whether an actor's process had it at ``__init__``.
SCRIPT = """
import json, os, sys
import ray
from rayconv.cluster import connect as c
os.cpu_count = lambda: c.PRELOAD_MIN_CORES

@ray.remote(num_cpus=1)
class Probe:
    def __init__(self):
        self.had = "wave" in sys.modules
    def had_wave(self):
        return self.had

how = c.connect(sys.argv[1] or None, min_cpus=2, preload=("wave",))
print(json.dumps([how, ray.get(Probe.remote().had_wave.remote())]))
"""


def _connect_in_a_fresh_process(address: str) -> list:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, address], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_cluster_rayconv_starts_preloads_and_one_it_joins_is_left_as_it_is(ray_cluster):
    assert _connect_in_a_fresh_process("local") == ["started", True]
    assert _connect_in_a_fresh_process(ray.get_runtime_context().gcs_address) == ["connected", False]


def test_the_actors_first_imports_follow_the_model_and_whether_the_part_is_compiled():
    assert first_imports("resnet18", "cuda", "auto") == ("torch", "torch._dynamo", "torchvision")
    assert first_imports("convnet", "cuda", "auto") == ("torch", "torch._dynamo")
    assert first_imports("convnet", "auto", "auto") == ("torch", "torch._dynamo")   # (before the cluster says)
    assert first_imports("convnet", "cuda", "off") == ("torch",)
    assert first_imports("convnet", "cpu", "auto") == ("torch",)
    assert first_imports("convnet", "cpu", "on") == ("torch", "torch._dynamo")
