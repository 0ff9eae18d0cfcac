"""How many Ray actors each test starts: a pytest plugin, and the report of what it wrote.

    # writes $ACTORS_PER_TEST_DIR (/tmp/actors-per-test):
    PYTHONPATH=benchmarks python -m pytest -q tests -p actors_per_test
    # per test process: actors by module, the runs' sizes:
    python benchmarks/actors_per_test.py [/tmp/actors-per-test]

Around each test, the plugin reads the connected cluster's actor table from its GCS
(``ray._private.state.actors``: every actor the cluster has had, the dead ones too) and writes one JSON line
per test to a file per test process (pytest-xdist's worker name): the actors that appeared (class and name;
rayconv's are named ``rayconv/<run>/<role>``, so each run's count of actors is its size) and whether the test
changed the cluster connection. Actors of clusters a test starts and ends itself are not seen.
"""

from __future__ import annotations

import collections
import json
import os
import sys

DIR = os.environ.get("ACTORS_PER_TEST_DIR", "/tmp/actors-per-test")


def _actors() -> tuple[str | None, dict[str, str]]:
    import ray

    if not ray.is_initialized():
        return None, {}
    try:
        table = ray._private.state.actors()
        return ray.get_runtime_context().gcs_address, {i: f"{a['ActorClassName']}|{a.get('Name') or ''}"
                                                       for i, a in table.items()}
    except Exception:  # noqa: BLE001 - a cluster going down between tests: nothing counted
        return None, {}


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before_gcs, before = _actors()
        yield
        after_gcs, after = _actors()
        new = sorted(v for k, v in after.items() if after_gcs != before_gcs or k not in before)
        os.makedirs(DIR, exist_ok=True)
        with open(os.path.join(DIR, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"), "a") as f:
            f.write(json.dumps({"test": item.nodeid, "new": new,
                                "cluster_changed": after_gcs != before_gcs}) + "\n")
except ImportError:   # (the report alone needs no pytest)
    pass


def report(folder: str) -> None:
    """Per test process: the actors started, by module in the order run, each test's runs' sizes."""
    total = 0
    for name in sorted(os.listdir(folder)):
        rows = [json.loads(line) for line in open(os.path.join(folder, name))]
        modules: dict[str, list] = collections.OrderedDict()
        for r in rows:
            m = modules.setdefault(r["test"].split("::")[0], [0, []])
            m[0] += len(r["new"])
            runs = collections.Counter(n.split("|")[1].split("/")[1] if n.count("/") >= 2 else n.split("|")[0]
                                       for n in r["new"])
            if runs:
                m[1].append(sorted(runs.values()))
        n = sum(m[0] for m in modules.values())
        total += n
        print(f"{name}: {n} actors started")
        for module, (count, sizes) in modules.items():
            if count:
                print(f"  {count:4d}  {module}  {sizes}")
    print(f"all: {total} actors started")


if __name__ == "__main__":
    report(sys.argv[1] if len(sys.argv) > 1 else DIR)
