"""The plain script rayconv's start-up is measured against: imports, the data onto the device, the model,
one SGD step; prints the seconds from the process's start (/proc/self/stat) to that step done.

    python benchmarks/first_step_anchor.py                                       # CPU: digits, ConvNet
    python benchmarks/first_step_anchor.py --model resnet18 --data fashion-mnist --image-size 64 \\
        --precision bf16 --device cuda --global-batch-size 512 --data-dir /usr/share/datasets/fashion-mnist

It does what a user's own script does, no more: torch (and torchvision for its models) imported, the
images read (the digits file scikit-learn ships; Fashion-MNIST's idx files), put on the device, resized
there (grey repeated to 3 channels for torchvision's models), one forward and backward (bf16 autocast
with ``--precision bf16``), one SGD step (momentum 0.9, weight decay 5e-4), the device synchronised.
Prints one line ``FIRST_STEP {json}``: ``first_step_s`` (from the process's start), and the seconds
each part took (``imports_s`` from the start, ``data_s``, ``model_s``, ``step_s``). rayconv's figure
is ``summary.json``'s ``startup.phases.first_step`` (``benchmarks/startup.sh`` runs both).
"""

from __future__ import annotations

import os
import time


def process_start() -> float:
    """time.monotonic() at this process's start (/proc/self/stat field 22 against CLOCK_BOOTTIME);
    the import of this script where /proc is absent."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


START = process_start()

import argparse  # noqa: E402 - the stamp first
import json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="convnet",
                   help="convnet (rayconv's small ConvNet) or a torchvision model")
    p.add_argument("--data", default="digits", choices=["digits", "fashion-mnist"])
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST's idx files (default: Debian's folder)")
    p.add_argument("--image-size", type=int, default=None, help="resize to S x S on the device")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F

    if args.model == "convnet":
        from rayconv.models.convnet import ConvNet  # (torch.nn only)
    else:
        import torchvision
    t_imports = time.monotonic()

    device = torch.device(args.device)
    if args.data == "digits":
        from rayconv.data.digits import digits_arrays  # (the file scikit-learn ships, read with numpy)

        images, labels = digits_arrays()
        x = (
            torch.from_numpy(((images - images.mean()) / images.std()).astype(np.float32))
            .unsqueeze(1)
            .to(device)
        )
    else:
        from rayconv.data.fashion_mnist import fashion_mnist_arrays  # (the idx files, read with numpy)

        images, labels = fashion_mnist_arrays(args.data_dir)["train"]
        x = torch.from_numpy(images).to(device)  # uint8 (N, 1, 28, 28) on the device
    y = torch.from_numpy(np.asarray(labels)).long().to(device)
    batch = x[:args.global_batch_size].float()
    if args.data != "digits":
        batch = (batch / 255.0 - 0.2860) / 0.3530
    if args.image_size:
        batch = F.interpolate(batch, size=(args.image_size,) * 2, mode="bilinear", antialias=True)
    if args.model != "convnet":
        batch = batch.expand(-1, 3, -1, -1)
    target = y[:args.global_batch_size]
    t_data = time.monotonic()

    torch.manual_seed(0)
    model = ConvNet(batch.shape[1], 10) if args.model == "convnet" else \
        torchvision.models.get_model(args.model, weights=None, num_classes=10)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    t_model = time.monotonic()

    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        loss = F.cross_entropy(model(batch), target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    float(loss.detach())  # (waits for the device)
    t_step = time.monotonic()
    print("FIRST_STEP " + json.dumps({
        "first_step_s": round(t_step - START, 3), "imports_s": round(t_imports - START, 3),
        "data_s": round(t_data - t_imports, 3), "model_s": round(t_model - t_data, 3),
        "step_s": round(t_step - t_model, 3), "model": args.model, "data": args.data,
        "image_size": args.image_size, "precision": args.precision, "device": args.device}), flush=True)


if __name__ == "__main__":
    main()
