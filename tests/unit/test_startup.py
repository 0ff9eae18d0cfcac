"""The start-up record (``rayconv.startup``): phases in the order they ended, the actors' setup splits
placed on the driver's clock, the slowest stretch and the console line (no Ray: marks at given times)."""

from __future__ import annotations

import time

import pytest

from rayconv import startup
from rayconv.startup import PHASES, StartupClock, process_start


def a_run() -> StartupClock:
    clock = StartupClock(100.0, "process start")
    for name, at in (("imports", 102.0), ("data", 103.0), ("ray", 103.5), ("actors_alive", 108.0)):
        clock.mark(name, at)
    clock.ray = "connected"
    clock.mark("actors_set_up", 110.0)
    # two actors: the slower one (setup 1.8 s) is the one the run waited for
    clock.mark_actors(
        [
            {"startup": {"model_built": 0.5, "optimizer_built": 0.6, "data_on_device": 1.0, "setup": 1.2}},
            {"startup": {"model_built": 0.3, "optimizer_built": 0.9, "data_on_device": 1.5, "setup": 1.8}},
            {"rank": 2},
        ]
    )  # (a report without splits is skipped)
    clock.mark("first_step", 111.0)
    return clock


def test_phases_are_in_the_order_they_ended_with_the_slowest_actors_splits_before_its_setups_end():
    rec = a_run().record()
    assert list(rec["phases"]) == ["imports", "data", "ray", "actors_alive", "model_built", "optimizer_built",
                                   "data_on_device", "actors_set_up", "first_step"]
    assert set(rec["phases"]) <= set(PHASES)
    times = list(rec["phases"].values())
    assert times == sorted(times) and times[0] > 0
    # the slow actor's splits, counted back from the end of its setup (110 - (1.8 - 0.3), 110 - (1.8 - 1.5))
    assert rec["phases"]["model_built"] == pytest.approx(8.5) and rec["phases"][
        "data_on_device"
    ] == pytest.approx(9.7)
    assert rec["phases"]["optimizer_built"] == pytest.approx(9.1)
    assert rec["actor_setup_s"] == {"model_built": 0.3, "optimizer_built": 0.9, "data_on_device": 1.5,
                                    "setup": 1.8}
    assert rec["origin"] == "process start" and rec["ray"] == "connected"


def test_the_slowest_phase_is_the_longest_stretch_up_to_the_first_step_and_the_line_names_it():
    clock = a_run()
    assert clock.slowest() == ("actors_alive", pytest.approx(4.5))
    clock.mark("graphs_captured", 140.0)  # after the first step: not a start-up stretch of the line
    assert clock.slowest()[0] == "actors_alive"
    assert clock.line() == "rayconv: step 0 done 11.0 s after the command; slowest: actors starting (4.5 s)"
    assert a_run().record()["slowest"] == {"phase": "actors_alive", "s": pytest.approx(4.5)}
    slow_ray = StartupClock(0.0, "fit call")
    slow_ray.ray = "started"
    slow_ray.mark("imports", 1.0)
    slow_ray.mark("ray", 7.0)
    slow_ray.mark("first_step", 9.0)
    assert slow_ray.line(
        3) == "rayconv: step 3 done 9.0 s after rayconv.fit was called; slowest: Ray starting (6.0 s)"


def test_a_phase_keeps_its_first_mark_and_unknown_names_are_refused():
    clock = StartupClock(0.0, "fit call")
    clock.mark("actors_alive", 5.0)
    clock.mark("actors_alive", 9.0)  # (a recovery's new actors)
    assert clock.phases == {"actors_alive": 5.0}
    with pytest.raises(ValueError, match="actors_alive"):
        clock.mark("actors_up")
    clock.mark_capture([])
    assert "graphs_captured" not in clock.phases
    clock.mark_capture([0.2, 0.4])
    assert "graphs_captured" in clock.phases and clock.actors["graph_capture"] == 0.4


def test_the_clock_of_a_run_is_claimed_once_and_a_new_one_begins_after():
    begun = startup.begin(None, "fit call")
    assert startup.claim() is begun  # (what rayconv.fit began, the driver takes)
    begun.mark("imports")
    later = startup.claim()  # a second run in the process: a new clock
    assert later is not begun and later.phases == {}
    started = process_start()
    assert started is None or started <= time.monotonic()



def test_the_commands_clock_starts_at_rayconvs_import_after_a_shells_other_commands():
    from rayconv.startup import command_origin
    assert command_origin(100.0, 100.05, 100.3) == (100.0, "process start")      # python started the process
    # `pip install ... && python ...`
    assert command_origin(100.0, 230.0, 230.2) == (230.0, "rayconv import")
    assert command_origin(None, 5.0, 5.2) == (5.2, "rayconv.run import")          # no /proc


def test_the_slowest_actors_wait_for_its_warm_up_and_its_process_stamps_are_placed_on_the_clock():
    now_wall, now_mono = time.time(), time.monotonic()
    clock = StartupClock(now_mono - 10.0, "process start")   # the command started 10 s ago
    clock.mark("actors_alive", now_mono - 4.0)
    clock.mark("actors_set_up", now_mono - 1.0)
    stamps = {"process_started": now_wall - 8.0, "init": now_wall - 7.0, "alive": now_wall - 4.5,
              "warmed_up": now_wall - 2.5, "build": now_wall - 3.0, "built": now_wall - 1.0, "renewed": None}
    clock.mark_actors(
        [
            {
                "startup": {"warmed_up": 0.5, "model_built": 1.0, "data_on_device": 1.5, "setup": 2.0},
                "stamps": stamps,
            },
            {
                "startup": {"warmed_up": 0.0, "model_built": 0.2, "data_on_device": 0.3, "setup": 0.4},
                "stamps": {"renewed": now_wall - 9.0},
            },
        ]
    )
    rec = clock.record()
    # the slow actor's build call began 2.0 s before the set-up ended (at 9.0 s): warmed up 0.5 s later
    assert rec["phases"]["actors_warmed_up"] == pytest.approx(7.5, abs=1e-6)
    assert rec["phases"]["model_built"] == pytest.approx(8.0, abs=1e-6)
    assert rec["actor_setup_s"]["warmed_up"] == 0.5
    process = rec["actor_process"]
    assert list(process) == ["process_started", "init", "alive", "build", "warmed_up", "built"]  # (by time)
    assert process["process_started"] == pytest.approx(2.0, abs=0.05) and process["built"] == pytest.approx(
        9.0, abs=0.05
    )
