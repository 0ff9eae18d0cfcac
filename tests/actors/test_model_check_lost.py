"""The model's check made by one of the run's actors for the driver (``driver.resolve.WarmCheck``), when
that actor is lost: a new actor that dies or does not answer in time (``ActorCheckLost``) leaves the
check to the driver, whose routing is the one it makes without actors; a kept actor lost so is a
recoverable ClusterError that says to run again. Real Ray actors that exit or hang in the call."""

from __future__ import annotations

import os
import time

import pytest
import ray

from rayconv.config import Config
from rayconv.driver.resolve import ActorCheckLost, WarmCheck, check_before_ray
from rayconv.errors import ClusterError
from rayconv.mesh import Mesh

CFG = Config(data="digits", model="convnet", device="cpu", global_batch_size=32).validate()
DATA = (10, (1, 8, 8), 1)   # the digits: classes, sample shape, the data's own channels


@ray.remote(num_cpus=0)
class LostChecker:
    """An actor whose model check never returns a routing: its process exits, or the call hangs."""

    def check_model(self, cfg, mesh, num_classes, sample_shape, data_channels, check=True):
        if cfg["seed"] == 0:
            os._exit(1)
        time.sleep(60)


def test_a_new_actor_lost_in_the_check_leaves_it_to_the_driver(ray_cluster):
    mesh = Mesh(1, 1, 1)
    with pytest.raises(ActorCheckLost):
        WarmCheck(LostChecker.remote(), 60, kept=False).with_data(*DATA).routing(CFG, mesh)
    hung = LostChecker.remote()
    try:
        with pytest.raises(ActorCheckLost):   # (no answer within the limit)
            WarmCheck(hung, 1.0, kept=False).with_data(*DATA).routing(Config(**{**CFG.to_dict(), "seed": 1}),
                                                                      mesh)
    finally:
        ray.kill(hung)
    # check_before_ray falls back to the driver's own check, and its routing is the driver's
    _, _, _, own = check_before_ray(CFG, None)
    _, _, _, after_loss = check_before_ray(CFG, None, WarmCheck(LostChecker.remote(), 60, kept=False))
    assert after_loss == own


def test_a_kept_actor_lost_in_the_check_says_to_run_again(ray_cluster):
    with pytest.raises(ClusterError, match="kept actor checking --model convnet was lost or stuck") as e:
        WarmCheck(LostChecker.remote(), 60, kept=True).with_data(*DATA).routing(CFG, Mesh(1, 1, 1))
    assert e.value.recoverable and "run again" in str(e.value)
