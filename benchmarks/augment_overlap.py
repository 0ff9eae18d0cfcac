"""Whether the next batch's augmentation, run on a side stream beside the training step, would shorten
the step: Fashion-MNIST held on the GPU at 64 px (pad-crop, flip, random erasing: rayconv's replayed
augmentation graph, ``OnDeviceSource.images``), resnet18's step replayed as one CUDA graph (batch 512,
bf16, channels_last; ``step_kernels.resnet18_step``). Prints the augmentation's ms per batch (host and
GPU), the step alone, the two one after the other, and the augmentation on a side stream while the step
replays.

    python benchmarks/augment_overlap.py [DATA_DIR]     # on a GPU machine
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from rayconv.data.registry import make_source
from rayconv.flags import parse_args
from stage_times import as_graph   # (this folder: the script's own is on sys.path)
from step_kernels import ms_per_call, resnet18_step


def main() -> None:
    data_dir = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/datasets/fashion-mnist"
    cfg = parse_args(f"--data fashion-mnist --data-dir {data_dir} --image-size 64 --augment pad-crop "
                     "--random-erase 0.5 --model resnet18".split())
    dev = torch.device("cuda")
    src = make_source(cfg)
    src.load(dev)
    rng = np.random.default_rng(0)

    def batch() -> torch.Tensor:
        x = src.images("train", rng.choice(60000, 512, replace=False), dev, 0, dtype=torch.bfloat16)
        return x.contiguous(memory_format=torch.channels_last)

    for _ in range(5):
        batch()
    print(f"augmentation alone {ms_per_call(batch, 200):.3f} ms/batch (wall)")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(50):
        batch()
    end.record()
    torch.cuda.synchronize()
    print(f"augmentation GPU span {begin.elapsed_time(end) / 50:.3f} ms/batch")
    step, images = resnet18_step(64, torch.bfloat16)   # (its images' buffer: each batch is copied in)
    replay = as_graph(step)
    print(f"step graph alone {ms_per_call(replay, 300):.3f} ms")

    def serial() -> None:
        images.copy_(batch())
        replay()

    print(f"augmentation, copy and step one after the other {ms_per_call(serial, 300):.3f} ms")
    side = torch.cuda.Stream()   # (the next batch's augmentation)
    ahead: list = [None]

    def overlapped() -> None:
        main_stream = torch.cuda.current_stream()
        if ahead[0] is None:
            ahead[0] = batch()
        images.copy_(ahead[0])
        copied = torch.cuda.Event()
        copied.record(main_stream)
        side.wait_event(copied)
        with torch.cuda.stream(side):
            nxt = batch()
        nxt.record_stream(main_stream)
        replay()
        main_stream.wait_stream(side)
        ahead[0] = nxt

    print(f"the next batch's augmentation on a side stream beside the step {ms_per_call(overlapped, 300):.3f} ms")


if __name__ == "__main__":
    main()
