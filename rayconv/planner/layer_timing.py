"""Each layer's measured forward + backward time: what ``--balance time`` balances pipeline stages by
and what the planner's cost model (``planner.measure``) reads.

``layer_times`` times a model's flat layers (``models.to_layers``) on one device; ``measured_costs``
does so for a run's model and settings, as a Ray task on the run's device (``driver.resolve``).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from rayconv.config import Config
from rayconv.data.registry import check_source
from rayconv.models import run_model, to_layers


def layer_times(layers: list[tuple[str, nn.Module]], sample_shape: tuple[int, ...], batch: int,
                device: torch.device, autocast: Optional[torch.dtype], reps: int = 5) -> list[float]:
    """Forward + backward time in ms of each layer on ``device`` for a micro-batch of ``batch`` images
    (torchgpipe's ``balance_by_time``, Kim et al. 2020, section 3.3): FLOPs misjudge layers bound by
    memory traffic (batch norm, ReLU and pooling on the large early activations). Each layer runs
    ``reps`` timed times after one untimed run, on the previous layer's output, eagerly (on CPU the
    median repetition)."""
    cuda = device.type == "cuda"
    fmt = torch.channels_last if cuda else torch.contiguous_format
    x = torch.randn((batch, *sample_shape), device=device).contiguous(memory_format=fmt)
    def amp():
        return torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None)

    times = []
    for i, (_, m) in enumerate(layers):
        m.to(device)
        if cuda:
            m.to(memory_format=torch.channels_last)
        m.train()
        reps_s = []  # on CPU each repetition's time: their median (a busy host's stray slow repetition)
        for r in range(reps + 1):
            if r == 1:
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            t_rep = time.perf_counter()
            # A non-leaf input (layers may start with an in-place ReLU), fresh each repetition.
            inp = x.detach().requires_grad_() * 1 if i > 0 else x
            with amp():
                out = m(inp)
            if out.requires_grad:
                out.float().sum().backward()
            if r >= 1 and not cuda:
                reps_s.append(time.perf_counter() - t_rep)
        if cuda:
            torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) / reps * 1e3)
        else:
            times.append(sorted(reps_s)[len(reps_s) // 2] * 1e3)
        with torch.no_grad(), amp():
            x = m(x).detach()
        m.zero_grad(set_to_none=True)
        m.to("cpu")
    return times


def measured_costs(cfg_dict: dict, micro_batch: int) -> list[float]:
    """``layer_times`` of the run's model on this process's device (run as a Ray task on a GPU by the
    driver's setup, ``driver.job``). Returns one time in ms per layer of ``models.to_layers``."""
    cfg = Config(**cfg_dict)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    source = check_source(cfg)   # (its shapes only: a set in a bucket is not fetched for them)
    return layer_times(to_layers(run_model(cfg, source)), tuple(source.sample_shape), micro_batch, device,
                       torch.bfloat16 if cfg.precision == "bf16" else None)
