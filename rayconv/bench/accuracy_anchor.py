"""The time-to-accuracy anchor: plain PyTorch training Fashion-MNIST on one GPU, with rayconv's recipe.

It is what a user of the field would write without rayconv: the whole data set held on the GPU as
uint8, pad-and-random-crop + flip (and optional random erasing) as tensor operations over the batch,
SGD with Nesterov momentum, linear warm-up then cosine (Goyal et al. 2017, section 2.2), label
smoothing (Szegedy et al. 2016, section 7), no weight decay on batch-norm and bias parameters,
the grey images seen as 3 equal channels by the unchanged torchvision model,
bf16 autocast and channels_last, eager or compiled (``torch.compile``). It imports nothing of rayconv,
so it measures plain PyTorch, and it reports what rayconv's ``summary.json`` reports for the same
recipe: the training seconds and wall-clock seconds until the test accuracy first reaches
``--target-accuracy``, the compile seconds apart, and the final test top-1.

    python -m rayconv.bench.accuracy_anchor --data-dir /usr/share/datasets/fashion-mnist \
        --image-size 64 --epochs 15 --compile both --out anchor.json

``--compile both`` runs eager and compiled in turn and reports both and the faster to the target.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: Path) -> np.ndarray:
    """An idx file (``.gz`` or plain) as a numpy array: uint8 images N x 28 x 28 or labels N."""
    for p in (path, path.with_name(path.name + ".gz")):
        if p.exists():
            raw = gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()
            ndim = raw[3]
            shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
            return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)
    raise SystemExit(
        f"accuracy_anchor: {path} not found: apt-get install dataset-fashion-mnist, or --data-dir")


def load(data_dir: Path, size: int, device: torch.device):
    """Both splits on ``device``: uint8 N x 1 x size x size images (resized once), int64 labels."""
    out = {}
    for split, (img, lab) in FILES.items():
        x = torch.from_numpy(read_idx(data_dir / img).copy()).to(device).unsqueeze(1)
        if size != x.shape[-1]:
            x = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True,
                              align_corners=False).round().clamp(0, 255).to(torch.uint8)
        out[split] = (x, torch.from_numpy(read_idx(data_dir / lab).astype(np.int64)).to(device))
    return out


def augment(x_u8: torch.Tensor, pad: int, erase: float, gen: torch.Generator) -> torch.Tensor:
    """uint8 B x C x S x S -> float B x C x S x S: reflect-pad, random crop, flip, erase, in batch ops."""
    b, c, s, _ = x_u8.shape
    x = F.pad(x_u8.float(), (pad, pad, pad, pad), mode="reflect")
    dev = x.device
    oy = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=gen)
    ox = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=gen)
    ar = torch.arange(s, device=dev)
    rows, cols = (oy[:, None] + ar)[:, :, None], (ox[:, None] + ar)[:, None, :]
    flip = torch.rand(b, device=dev, generator=gen) < 0.5
    cols = torch.where(flip[:, None, None], cols.flip(-1), cols)
    x = x[torch.arange(b, device=dev)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)  # B x C x S x S
    # one rectangle of 2-33% of the area, aspect 0.3-3.3, filled with 0 (the mean after normalising)
    if erase > 0:
        area = torch.empty(b, device=dev).uniform_(0.02, 0.33, generator=gen) * s * s
        ratio = torch.exp(torch.empty(b, device=dev).uniform_(math.log(0.3), math.log(3.3), generator=gen))
        h = (area * ratio).sqrt().round().clamp(1, s)
        w = (area / ratio).sqrt().round().clamp(1, s)
        y0 = (torch.rand(b, device=dev, generator=gen) * (s - h + 1)).floor()
        x0 = (torch.rand(b, device=dev, generator=gen) * (s - w + 1)).floor()
        on = torch.rand(b, device=dev, generator=gen) < erase
        inside = ((ar[None, :, None] >= y0[:, None, None]) & (ar[None, :, None] < (y0 + h)[:, None, None])
                  & (ar[None, None, :] >= x0[:, None, None]) & (ar[None, None, :] < (x0 + w)[:, None, None]))
        return x, (inside & on[:, None, None]).unsqueeze(1)
    return x, None


def lr_schedule(a, steps_per_epoch: int):
    """lr of a step: linear warm-up from lr x warm-up decay over the warm-up epochs, then cosine to 0."""
    total, warm = steps_per_epoch * a.epochs, steps_per_epoch * a.lr_warmup_epochs

    def lr_at(step: int) -> float:
        if step < warm:
            return a.lr * (a.lr_warmup_decay + (1 - a.lr_warmup_decay) * step / warm)
        return a.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))
    return lr_at


def model_and_optimizer(a, compiled: bool):
    """The torchvision model (compiled or not) and Nesterov SGD without decay on norms and biases."""
    torch.manual_seed(a.seed)
    model = torchvision.models.get_model(a.model, num_classes=10).cuda().to(memory_format=torch.channels_last)
    if a.bn_momentum is not None:   # every batch norm's running-statistics momentum (rayconv's --bn-momentum)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.momentum = a.bn_momentum
    norm_or_bias = [p for p in model.parameters() if p.ndim <= 1]
    rest = [p for p in model.parameters() if p.ndim > 1]
    opt = torch.optim.SGD([{"params": rest, "weight_decay": a.weight_decay},
                           {"params": norm_or_bias, "weight_decay": a.norm_weight_decay}],
                          lr=a.lr, momentum=0.9, nesterov=True)
    return (torch.compile(model, mode=a.compile_mode) if compiled else model), opt


def train(a, data, compiled: bool) -> dict:
    """Train, evaluating after every epoch; the curve and the time to ``--target-accuracy``."""
    model, opt = model_and_optimizer(a, compiled)
    (xtr, ytr), (xte, yte) = data["train"], data["test"]
    mean, std = xtr.float().mean() / 255, xtr.float().std() / 255

    def inputs(x):  # B x 1 x S x S in [0, 255] -> normalised, seen by the model as 3 equal channels (a view)
        return ((x / 255 - mean) / std).expand(-1, 3, -1, -1).contiguous(memory_format=torch.channels_last)

    steps_per_epoch = xtr.shape[0] // a.global_batch_size
    lr_at = lr_schedule(a, steps_per_epoch)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    curve, t_train, t_first, reached, start = [], 0.0, None, {}, time.perf_counter()
    for epoch in range(a.epochs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        perm = torch.randperm(xtr.shape[0], device="cuda", generator=gen)
        model.train()
        for i in range(steps_per_epoch):
            for g in opt.param_groups:
                g["lr"] = lr_at(epoch * steps_per_epoch + i)
            idx = perm[i * a.global_batch_size:(i + 1) * a.global_batch_size]
            x, mask = augment(xtr[idx], a.pad, a.random_erase, gen)
            x = inputs(x if mask is None else x.masked_fill(mask, float(mean * 255)))
            with torch.autocast("cuda", torch.bfloat16):
                loss = F.cross_entropy(model(x), ytr[idx], label_smoothing=a.label_smoothing)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if t_first is None:
                torch.cuda.synchronize()
                t_first = time.perf_counter() - t0  # the first step holds the compilation
        torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        if a.precise_bn_batches:   # rayconv's --precise-bn-batches (evaluation time, as there): update_bn
            calib = torch.Generator(device="cuda").manual_seed(a.seed + 1_000_003 * (epoch + 1))
            with torch.autocast("cuda", torch.bfloat16):
                torch.optim.swa_utils.update_bn(
                    (recalibration_batch(a, xtr, perm, i % steps_per_epoch, calib, inputs, mean)
                     for i in range(a.precise_bn_batches)), model)
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            correct = sum(int((model(inputs(xte[j:j + 1000].float())).argmax(1) == yte[j:j + 1000]).sum())
                          for j in range(0, xte.shape[0], 1000))
        acc, wall = correct / xte.shape[0], time.perf_counter() - start
        curve.append({"epoch": epoch + 1, "train_s": t_train, "wall_s": wall, "test_accuracy": acc})
        if acc >= a.target_accuracy and not reached:
            reached = {"time_to_target_train_s": t_train, "time_to_target_wall_s": wall}
        print(f"anchor {'compiled' if compiled else 'eager'} epoch {epoch + 1} acc {acc:.4f} "
              f"train {t_train:.1f} s wall {wall:.1f} s", flush=True)
    return {"mode": "compiled" if compiled else "eager", "final_test_accuracy": curve[-1]["test_accuracy"],
            "first_step_s": t_first, "train_s": t_train,
            "images_per_s": steps_per_epoch * a.global_batch_size * a.epochs / t_train,
            **({"time_to_target_train_s": None, "time_to_target_wall_s": None} | reached), "curve": curve}


def recalibration_batch(a, xtr, perm, i, gen, inputs, mean) -> torch.Tensor:
    """Batch ``i`` of this epoch's order augmented afresh from ``gen`` (a generator of its own: the
    training's draws stay as they are), as the model sees it: for ``--precise-bn-batches``."""
    x, mask = augment(xtr[perm[i * a.global_batch_size:(i + 1) * a.global_batch_size]], a.pad, a.random_erase,
                      gen)
    return inputs(x if mask is None else x.masked_fill(mask, float(mean * 255)))


def process_age_s():
    """Seconds since this process started (/proc/self/stat's start time, field 22, in clock ticks after
    boot, against CLOCK_BOOTTIME); None where either is missing."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rayconv.bench.accuracy_anchor",
                                description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist",
                   help="folder of the four idx files")
    p.add_argument("--model", default="resnet18", help="torchvision classification model")
    p.add_argument("--image-size", type=int, default=64,
                   help="side in pixels the 28-pixel images are resized to")
    p.add_argument("--pad", type=int, default=None,
                   help="random-crop padding in pixels (default: image size / 8)")
    p.add_argument("--epochs", type=int, default=15, help="epochs")
    p.add_argument("--global-batch-size", type=int, default=512, help="images per step")
    p.add_argument("--lr", type=float, default=0.4, help="peak learning rate")
    p.add_argument("--lr-warmup-epochs", type=int, default=2, help="linear warm-up epochs")
    p.add_argument("--lr-warmup-decay", type=float, default=0.01,
                   help="first warm-up lr as a fraction of --lr")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="label smoothing")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay of weights")
    p.add_argument("--norm-weight-decay", type=float, default=0.0,
                   help="weight decay of batch-norm and bias parameters")
    p.add_argument("--bn-momentum", type=float, default=None, help="batch norms' running-statistics momentum")
    p.add_argument("--precise-bn-batches", type=int, default=0,
                   help="before each evaluation, batch norms' statistics recomputed over N training batches "
                        "(update_bn; 0: off)")
    p.add_argument("--random-erase", type=float, default=0.0, help="probability of erasing a rectangle")
    p.add_argument("--target-accuracy", type=float, default=0.93,
                   help="test accuracy whose first time is reported")
    p.add_argument("--compile", choices=("off", "on", "both"), default="both", help="eager, compiled or both")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode")
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--out", default=None, help="JSON file for the results")
    a = p.parse_args(argv)
    a.pad = a.pad if a.pad is not None else max(1, a.image_size // 8)
    data = load(Path(a.data_dir), a.image_size, torch.device("cuda"))
    # From the process's start (the command) to the data on the GPU: imports, CUDA start, the idx files
    # read. Each mode's time from the command is this plus its own wall time to the target, as though
    # it ran alone (the compiled mode, run second, does not count the eager run before it).
    setup_s = process_age_s()
    runs = [train(a, data, c) for c in {"off": [False], "on": [True], "both": [False, True]}[a.compile]]
    for r in runs:
        r["command_to_train_s"] = setup_s
        r["time_to_target_since_s"] = (None if setup_s is None or r["time_to_target_wall_s"] is None
                                       else setup_s + r["time_to_target_wall_s"])
    reached = [r for r in runs if r["time_to_target_wall_s"] is not None]
    best = min(reached, key=lambda r: r["time_to_target_wall_s"]) if reached else max(
        runs, key=lambda r: r["final_test_accuracy"])
    result = {"settings": vars(a), "runs": runs, "best": best["mode"]}
    for r in runs:
        print(f"anchor {r['mode']}: final {r['final_test_accuracy']:.4f}, to {a.target_accuracy}: "
              f"{r['time_to_target_wall_s']} s wall ({r['time_to_target_train_s']} s training; "
              f"{r['time_to_target_since_s']} s from the command), first step "
              f"{r['first_step_s']:.1f} s, {r['images_per_s']:.0f} images/s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
