"""The kept actor's watchdog (``cluster.watch``): a claim succeeds once, for the key it was kept for;
the actors' key changes with the code."""

from __future__ import annotations

import threading

from rayconv.cluster import watch
from rayconv.cluster.pool import actors_key


def test_a_kept_actor_is_claimed_once_and_only_for_its_key():
    w = watch.Watch("job-a")           # (no Ray here: the job counts as alive, nothing ends)
    assert not w.claim("k", "job-b")   # in use, not kept
    assert w.keep("k", 600, "kept/x/y") == watch.code_hash()
    assert not w.claim("other", "job-b")
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(w.claim("k", "job-b"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True] and w.job == "job-b" and w.entry is None


def test_the_key_holds_the_code_hash():
    key = actors_key(object, 1, {"CPU": 1}, None)
    old = watch._CODE.get("h")
    watch._CODE["h"] = "other code"
    try:
        assert actors_key(object, 1, {"CPU": 1}, None) != key
    finally:
        watch._CODE["h"] = old
