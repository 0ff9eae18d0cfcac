"""What rayconv refuses without a cluster: the settings and the output folder before Ray is contacted
(exit 2 and one line); the data, the model and the layout against the model in the one check that
needs no cluster (``check_before_ray``, which a run makes while its actors start: one line, an error
that the command turns into exit 2; tests/actors/test_bad_input.py's ``test_unknown_model`` shows
that such a refusal leaves nothing on the cluster); and every torchvision classification model either
trains or is refused that way."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
import torchvision
from PIL import Image

from rayconv.config import ConfigError
from rayconv.driver.resolve import check_before_ray
from rayconv.errors import DataError, LayoutError
from rayconv.models import build_model, check_trainable, to_layers
from rayconv.run import main, parse_command_line


def image_tree(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            Image.fromarray(rng.integers(0, 256, (36, 36, 3),
                                         dtype=np.uint8)).save(root / split / c / "a.png")
    return root


def no_val(root: Path) -> Path:
    (root / "cat").mkdir(parents=True)
    Image.fromarray(np.zeros((36, 36, 3), dtype=np.uint8)).save(root / "cat" / "a.png")
    return root


def full_folder(p: Path) -> Path:
    p.mkdir()
    (p / "notes.txt").write_text("keep me")
    return p


def a_file(p: Path) -> Path:
    p.write_text("a file")
    return p


def under_a_file(p: Path) -> Path:
    return a_file(p) / "sub"


def under_proc(p: Path) -> Path:
    return Path("/proc") / f"rayconv-test-{p.parent.name}"   # (root too cannot make files there)


# Refused before Ray is contacted: (flags, how --out is made or None, words the one line must hold)
CASES = {
    "out holds files": ([], full_folder, ["--out", "already holds files"]),
    "out is a file": ([], a_file, ["--out", "is a file"]),
    "sync batch norm on cpu": (["--sync-batchnorm"], None, ["--sync-batchnorm", "--device cpu"]),
    "out under a file": ([], under_a_file, ["--out", "is a file, not a folder"]),
    "out under /proc": ([], under_proc, ["--out /proc/rayconv-test-", "cannot be written"]),
    "a negative seed": (["--seed", "-1"], None, ["--seed", "(got -1)"]),
    "a seed past torch's": (["--seed", str(2**64)], None, ["--seed", "2**64"]),
    "digits resized": (["--image-size", "224"], None, ["--data digits", "never resized", "--image-size 224",
                                                       "--data fashion-mnist"]),
    "digits augmented": (["--augment", "resized-crop"], None,
                         ["--augment resized-crop", "not --data digits"]),
    "synthetic erased": (["--data", "synthetic", "--random-erase", "0.5"], None,
                         ["--random-erase", "synthetic"]),
}
# Refused by ``check_before_ray`` (a run's actors start meanwhile): (flags, words the one line must hold)
LATE = {
    "data-dir missing": (
        ["--data", "imagefolder", "--data-dir", "{tmp}/nothing-here"],
        ["{tmp}/nothing-here/train", "does not exist", "--data-dir"],
    ),
    "no train/ val/": (["--data", "imagefolder", "--data-dir", "{data}"], ["{data}/train", "does not exist"]),
    "unknown model": (
        ["--model", "resnet1000"],
        ["resnet1000", "convnet_bn", "convnet2col", "alexnet2012", "list_models"],
    ),
    "vit at 64 px": (
        ["--model", "vit_b_32", "--data", "synthetic", "--image-size", "64"],
        ["vit_b_32", "64x64", "--image-size 224"],
    ),
    "3-channel model on digits": (
        ["--model", "resnet18", "--channels", "1"],
        ["resnet18", "3-channel", "--data"],
    ),
    "classes differ": (["--num-classes", "7"], ["--num-classes 7", "10 classes"]),
    "pipeline of an uncuttable model": (
        ["--model", "convnext_tiny", "--data", "synthetic", "--image-size", "64", "--pp", "2"],
        ["convnext_tiny", "--pp 1"],
    ),
    "stages out of range": (["--pp", "2", "--stages", "99"], ["--stages"]),
    "a 224-pixel model on digits": (
        ["--model", "alexnet"],  # (advice digits can follow: never --image-size)
        ["alexnet", "8x8", "--data digits is never resized", "convnet",
         "--data fashion-mnist --image-size 224", "!use --image-size"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_ray(case, tmp_path, capsys, silent_address):
    address, contacts = silent_address
    flags, make_out, words = CASES[case]
    data = no_val(tmp_path / "data")
    fill = {"{tmp}": str(tmp_path), "{data}": str(data)}

    def sub(text: str) -> str:
        for k, v in fill.items():
            text = text.replace(k, v)
        return text

    out = make_out(tmp_path / "out") if make_out else tmp_path / "out"
    before = sorted(out.iterdir()) if out.is_dir() else None
    connected = ray.is_initialized()  # (a cluster of another module's tests may still be up)
    capsys.readouterr()
    rc = main(["--address", address, "--device", "cpu", "--steps", "1", "--no-progress", "--out", str(out),
               *[sub(f) for f in flags]])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("rayconv: error: "), captured.err
    for w in words:
        assert sub(w) in lines[0], lines[0]
    assert "*.JPEG" not in lines[0]
    assert not contacts and ray.is_initialized() == connected, "a cluster was contacted before the refusal"
    assert captured.out == "", "no header for a run that never started"
    if make_out is None or not out.parent.is_dir():
        assert not out.exists()
    elif before is not None:
        assert sorted(out.iterdir()) == before


@pytest.mark.parametrize("case", list(LATE))
def test_refused_by_the_check_without_cluster(case, tmp_path):
    """The check the run makes while its actors start, on the settings the command line gives: the
    error is one the command exits 2 with, one line holding the words; no cluster is contacted."""
    flags, words = LATE[case]
    fill = {"{tmp}": str(tmp_path), "{data}": str(no_val(tmp_path / "data"))}

    def sub(text: str) -> str:
        for k, v in fill.items():
            text = text.replace(k, v)
        return text

    connected = ray.is_initialized()
    cfg = parse_command_line(["--device", "cpu", "--steps", "1", "--out", str(tmp_path / "out"),
                              *[sub(f) for f in flags]])
    with pytest.raises((ConfigError, DataError, LayoutError)) as e:   # (rayconv.run.main: exit 2)
        check_before_ray(cfg, None)
    line = str(e.value)
    assert "\n" not in line and "*.JPEG" not in line, line
    for w in words:   # ("!": a word the line must not hold)
        assert (sub(w[1:]) not in line) if w.startswith("!") else (sub(w) in line), line
    assert ray.is_initialized() == connected and not (tmp_path / "out").exists()


# Each kind of torchvision classification model (the class its builder returns), by its smallest member.
REPRESENTATIVES = {"AlexNet": "alexnet", "ConvNeXt": "convnext_tiny", "DenseNet": "densenet121",
                   "EfficientNet": "efficientnet_b0", "GoogLeNet": "googlenet", "Inception3": "inception_v3",
                   "MaxVit": "maxvit_t", "MNASNet": "mnasnet0_5", "MobileNetV2": "mobilenet_v2",
                   "MobileNetV3": "mobilenet_v3_small", "RegNet": "regnet_x_400mf", "ResNet": "resnet18",
                   "ShuffleNetV2": "shufflenet_v2_x0_5", "SqueezeNet": "squeezenet1_1",
                   "SwinTransformer": "swin_t", "VGG": "vgg11", "VisionTransformer": "vit_b_32"}
# Made for 224x224 images: refused at 64 (one line naming --image-size 224).
FIXED_SIZE = {"inception_v3", "maxvit_t", "vit_b_32"}


@pytest.mark.slow
def test_every_torchvision_model_trains_or_is_refused():
    """All of torchvision.models.list_models(): each kind's training forward (on the meta device, the
    way ``driver.resolve.resolve_on_cluster`` checks it) gives class scores at 64x64, or the model is refused
    in one line; and rayconv views it as a layer list. A kind of model not seen here fails the test."""
    kinds: dict[str, list[str]] = {}
    for name in torchvision.models.list_models(module=torchvision.models):
        cls = inspect.signature(torchvision.models.get_model_builder(name)).return_annotation
        kinds.setdefault(getattr(cls, "__name__", str(cls)), []).append(name)
    assert kinds.keys() == REPRESENTATIVES.keys(), "a kind of model without a representative here: add one"
    for kind, name in REPRESENTATIVES.items():
        assert name in kinds[kind]
        try:
            with torch.device("meta"):
                model = build_model(name, 10, 3, 64)
        except NotImplementedError:  # RegNet's builder computes its widths with tensors: built for real
            model = build_model(name, 10, 3, 64)
        assert to_layers(model)
        if name in FIXED_SIZE:
            with pytest.raises(ConfigError) as e:
                check_trainable(name, model, (3, 64, 64))
            msg = str(e.value)
            assert len(msg.splitlines()) == 1 and f"--model {name} cannot take 64x64" in msg \
                and "--image-size 224" in msg, msg
        else:
            check_trainable(name, model, (3, 64, 64))
