"""Whether the next batch's augmentation, run on a side stream beside the training step, would shorten
the step: Fashion-MNIST held on the GPU at 64 px (pad-crop, flip, random erasing: rayconv's replayed
augmentation graph, ``OnDeviceSource.images``), resnet18's step replayed as one CUDA graph (batch 512,
bf16, channels_last). Prints the augmentation's ms per batch (host and GPU), the step alone, the two one
after the other, and the augmentation on a side stream while the step replays.

    python benchmarks/augment_overlap.py [DATA_DIR]     # on a GPU machine
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torchvision

from rayconv.actor.cuda_graph import sgd_step
from rayconv.data.registry import make_source
from rayconv.flags import parse_args


def ms_per_call(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


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
    print(f"augmentation alone {ms_per_call(batch):.3f} ms/batch (wall)")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(50):
        batch()
    end.record()
    torch.cuda.synchronize()
    print(f"augmentation GPU span {begin.elapsed_time(end) / 50:.3f} ms/batch")
    model = torchvision.models.resnet18(num_classes=10).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    lr = {torch.float32: torch.tensor(0.1, device=dev)}
    images = torch.empty(512, 3, 64, 64, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (512,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(model(images), labels)
        loss.backward()
        sgd_step(opt, lr)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    print(f"step graph alone {ms_per_call(graph.replay, 300):.3f} ms")

    def serial() -> None:
        images.copy_(batch())
        graph.replay()

    print(f"augmentation, copy and step one after the other {ms_per_call(serial, 300):.3f} ms")
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
        graph.replay()
        main_stream.wait_stream(side)
        ahead[0] = nxt

    print(f"the next batch's augmentation on a side stream beside the step {ms_per_call(overlapped, 300):.3f} ms")


if __name__ == "__main__":
    main()
