"""What setting up cuDNN and cuBLAS ahead saves a first training step: a fresh process (torch and
torchvision imported, the CUDA context made) runs resnet18's first step at 64 px (batch 512, bf16
autocast, channels_last), either at once (``cold``) or after the tiny convolution, batch norm and linear
layer a rayconv actor's warm-up runs (``warm``: ``build.set_up_cuda_libraries``). Each line: the
warm-up's seconds and the first step's.

    for i in 1 2 3; do python benchmarks/cuda_library_warmup.py cold; python benchmarks/cuda_library_warmup.py warm; done
"""

from __future__ import annotations

import sys
import time

import torch
import torchvision

from rayconv.actor.build import set_up_cuda_libraries

F = torch.nn.functional


def main() -> None:
    warm = sys.argv[1] == "warm"
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    if warm:
        assert set_up_cuda_libraries(dev, "bf16")
    warm_s = time.perf_counter() - t
    model = torchvision.models.resnet18(num_classes=10).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xb = torch.randn(512, 3, 64, 64, device=dev).contiguous(memory_format=torch.channels_last)
    yb = torch.randint(0, 10, (512,), device=dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.autocast("cuda", torch.bfloat16):
        loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    print(f"{sys.argv[1]}: warm-up {warm_s:.3f} s, first step {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
