"""What keeps an actor's start fast: no torchvision or scikit-learn imported for rayconv's own models and
the digits, with their suffix list and digits file equal to those libraries' own."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from rayconv.data.digits import digits_arrays
from rayconv.data.folders import IMAGE_SUFFIXES


def test_image_suffixes_are_torchvisions():
    """rayconv.data writes torchvision's ImageFolder suffixes out (importing torchvision costs each
    actor seconds); they must stay the same set."""
    from torchvision.datasets.folder import IMG_EXTENSIONS


    assert sorted(IMAGE_SUFFIXES) == sorted(IMG_EXTENSIONS)


def test_a_run_of_rayconvs_own_model_does_not_import_torchvision():
    """An actor of a convnet run on the digits imports the actor module, builds its part and reads data
    without torchvision (whose import pulls in torch._dynamo) or scikit-learn: seconds per actor; nor
    does the driver's check of that run (``check_before_ray``). The actor's modules import neither
    pyarrow (metrics.parquet is the driver's, written later) nor triton (torch.profiler's and the
    planner's FLOP counter): each actor's start pays every import. Nor does the driver's check of it import
    torch._dynamo (the meta device's first use and torch's FLOP counter do: seconds at every start)."""
    code = (
        "import sys; from rayconv.actor import actor; print(*(m in sys.modules for m in ('pyarrow',"
        " 'triton'))); from rayconv.driver import job, resolve; from rayconv.data import registry as data;"
        " from rayconv import models; from rayconv.config import Config; cfg ="
        " Config(model='convnet').validate(); src = data.make_source(cfg);"
        " models.to_layers(models.run_model(cfg, src)); resolve.check_before_ray(cfg, None);"
        " print('torchvision' in sys.modules, 'sklearn' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False False", "False False False"], (out.stdout,
                                                                                out.stderr[-2000:])


def test_the_actors_start_before_the_driver_imports_torch():
    """What the driver runs up to starting a run's actors (``driver.early.start_first``; ``driver.prestart``:
    the output folder, Ray, the layout; the actor class named to Ray) imports no torch, so the actors'
    processes start and import it while the driver imports its own."""
    code = ("import sys; import rayconv.run, rayconv.api; from rayconv.driver import early, prestart; "
            "from rayconv.actor.actor import Actor; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])


def test_digits_read_without_scikit_learn_equal_load_digits():
    from sklearn.datasets import load_digits

    images, targets = digits_arrays()
    d = load_digits()
    assert images.shape == (1797, 8, 8) and np.array_equal(images, d.images)
    assert np.array_equal(targets, d.target)


def test_runs_that_need_torch_before_their_layout_start_their_actors_after_it():
    """``driver.early.can_start_first``: a resumed run (its checkpoint's steps), a user's model (its
    module imports torch), an ``--init`` file, ``--layout auto`` (the planner) and runs whose checks
    need the cluster's devices start their actors once the driver has imported torch."""
    from rayconv.config import Config
    from rayconv.driver.early import can_start_first

    assert can_start_first(Config().validate()) and can_start_first(Config(model="resnet18", dp=2).validate())
    for settings in ({"resume": "runs/x"}, {"model": "mymodels:build"}, {"init": "weights.pt"},
                     {"layout": "auto"}, {"device": "cuda", "data": "shards", "data_dir": "d"},
                     {"device": "cuda", "gpus_per_actor": 0.5}):
        assert not can_start_first(Config(**settings)), settings


def test_the_driver_checks_a_small_model_on_the_cpu_and_a_large_one_on_meta():
    """``models.cheap_on_cpu``: rayconv's ConvNet on small images runs check_trainable's forward on the
    CPU; torchvision's models on the meta device. Both paths refuse a forward that returns no tensor."""
    import pytest
    from torch import nn

    from rayconv.errors import ConfigError
    from rayconv.models import build_model, check_trainable, cheap_on_cpu

    assert cheap_on_cpu(build_model("convnet", 10, 1, 8), (1, 8, 8))
    assert not cheap_on_cpu(build_model("resnet18", 10, 3, 32), (3, 32, 32))

    class Pair(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.conv = nn.Conv2d(3, width, 3)

        def forward(self, x):
            return self.conv(x), x

    for width, on_cpu in ((4, True), (16384, False)):   # (16384 x 28 parameters x 64 x 64 pixels > the bound)
        model = Pair(width)
        assert cheap_on_cpu(model, (3, 64, 64)) == on_cpu
        with pytest.raises(ConfigError, match="returns tuple when training"):
            check_trainable("pair", model, (3, 64, 64))
    assert check_trainable("convnet", build_model("convnet", 10, 1, 8), (1, 8, 8)) == (2, 10)
