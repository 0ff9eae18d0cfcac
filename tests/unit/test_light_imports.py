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
    planner's FLOP counter): each actor's start pays every import."""
    code = ("import sys; from rayconv.actor import actor; "
            "print(*(m in sys.modules for m in ('pyarrow', 'triton'))); "
            "from rayconv.driver import job, resolve; from rayconv.data import registry as data; from rayconv import models; "
            "from rayconv.config import Config; cfg = Config(model='convnet').validate(); "
            "src = data.make_source(cfg); models.to_layers(models.run_model(cfg, src)); resolve.check_before_ray(cfg, None); "
            "print('torchvision' in sys.modules, 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False False", "False False"], (out.stdout, out.stderr[-2000:])


def test_digits_read_without_scikit_learn_equal_load_digits():
    from sklearn.datasets import load_digits

    images, targets = digits_arrays()
    d = load_digits()
    assert images.shape == (1797, 8, 8) and np.array_equal(images, d.images)
    assert np.array_equal(targets, d.target)
