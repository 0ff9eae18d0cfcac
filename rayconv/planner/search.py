"""Choosing the layout: rank every layout by the cost model's prediction, pick the fastest that fits.

This is the searching half of the planner; ``planner.costmodel`` is the model of a step, and
``python -m rayconv.plan`` the command.

The measurements (cached) are ``planner.measure``'s; the link table and the machines predicted for
(``--machine``) are ``planner.links``', with their sources.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from rayconv.cluster.connect import available_devices, connect
from rayconv.config import Config, ConfigError
from rayconv.data.registry import make_source
from rayconv.layout import Layout
from rayconv.user_model import is_user_model
from rayconv.planner import costmodel
from rayconv.planner.costmodel import Prediction
from rayconv.planner.links import MACHINES, Links
from rayconv.planner.measure import Measurements, profile_of
from rayconv.planner.memory import peak_gib
from rayconv.planner.profile import LayerTimes, Profile


def candidates(profile: Profile, world_size: int, global_batch: int, gpus_per_node: int = 8,
               microbatch_factors: Sequence[int] = (1, 2, 4)) -> list[Layout]:
    """Every layout over exactly ``world_size`` actors the model and batch allow: meshes
    ``dp x pp x fs`` (fs only within a node and up to ``profile.max_fs``; pp up to the layer count)
    with ``M = pp x factor`` micro-batches under 1F1B and GPipe, interleaved 1F1B with 2 chunks per
    stage (fs = 1), and the per-layer plan over all actors."""
    out: list[Layout] = []
    L = profile.num_layers
    for dp in range(1, world_size + 1):
        if world_size % dp or global_batch % dp:
            continue
        rest = world_size // dp
        for pp in range(1, rest + 1):
            if rest % pp or pp > L:
                continue
            fs = rest // pp
            if fs > 1 and (fs > profile.max_fs or fs > gpus_per_node):
                continue
            if pp == 1:
                out.append(Layout(dp=dp, fs=fs))
                continue
            for m in sorted({pp * f for f in microbatch_factors}):
                if (global_batch // dp) % m:
                    continue
                out.append(Layout(dp=dp, pp=pp, fs=fs, num_microbatches=m))
                out.append(Layout(dp=dp, pp=pp, fs=fs, num_microbatches=m, schedule="gpipe"))
                if fs == 1 and 2 * pp <= L:
                    out.append(Layout(dp=dp, pp=pp, num_microbatches=m, virtual_stages=2))
    if world_size > 1 and profile.first_fc is not None and profile.max_fs >= world_size \
            and global_batch % world_size == 0:
        out.append(Layout(dp=world_size, plan="krizhevsky2014"))
    return out


def batch_sizes(layouts: Sequence[Layout], global_batch: int) -> list[tuple[int, int]]:
    """The (batch size, fs) pairs ``predict`` asks the layer times for, over ``layouts``."""
    sizes = set()
    for lay in layouts:
        if lay.plan != "none":
            sizes |= {(global_batch, lay.dp), (global_batch // lay.dp, 1)}
        else:
            mb = global_batch // lay.dp // lay.num_microbatches_or_1
            sizes |= {(mb, lay.fs), (mb, 1)}
    return sorted(s for s in sizes if s[0] >= 1)


def rank(layouts: Sequence[Layout], profile: Profile, times: LayerTimes, links: Links, global_batch: int,
         precision: str = "fp32", max_memory_gib: Optional[float] = None,
         bucket_mb: float = 25.0) -> tuple[list[Prediction], list[Prediction]]:
    """Predictions of ``layouts``, fastest first: (those that fit in ``max_memory_gib`` per actor,
    those that do not)."""
    preds = [costmodel.predict(lay, profile, times, links, global_batch, precision, bucket_mb)
             for lay in layouts]
    preds.sort(key=lambda p: (-p.images_per_s, p.peak_gib, p.layout.name))
    fits = [p for p in preds if max_memory_gib is None or p.peak_gib <= max_memory_gib]
    return fits, [p for p in preds if p not in fits]


def explain(best: Prediction, others: Sequence[Prediction], single: Optional[Prediction]) -> str:
    """One line saying why ``best`` was chosen: its rate, margin over the next, what its step is."""
    parts = [f"{best.layout.name}: predicted {best.images_per_s:,.0f} images/s"]
    if single is not None and single.layout != best.layout:
        parts[0] += f" ({best.images_per_s / single.images_per_s:.2f}x one device)"
    nxt = next((p for p in others if p.layout != best.layout), None)
    if nxt is not None:
        parts.append(f"{best.images_per_s / nxt.images_per_s - 1:.0%} above the next, {nxt.layout.name}")
    costs = {"compute": best.compute_ms, "exchange": best.exchange_ms, "all-reduce": best.allreduce_ms,
             "bubble": best.bubble_ms}
    overhead = {k: v for k, v in costs.items() if k != "compute" and v > 0}
    share = best.compute_ms / best.step_ms if best.step_ms > 0 else 1.0
    parts.append(f"{share:.0%} of its step is compute" + (
        f", the largest other cost {max(overhead, key=overhead.get)}" if overhead else ""))
    parts.append(f"peak {best.peak_gib:.2f} GiB per device")
    return "; ".join(parts)


def fmt_table(preds: Sequence[Prediction], single: Optional[Prediction] = None) -> str:
    """A ranked text table: layout, images/s, speedup over ``single``, step ms and its split, peak GiB."""
    w = max([len("layout")] + [len(p.layout.name) for p in preds]) + 2
    head = (
        f"{'rank':>4} "
        f" {'layout':<{w}}{'images/s':>10}{'speedup':>8}{'step ms':>9}{'compute':>9}{'exchange':>9}"
        f"{'all-red.':>9}{'bubble':>8}{'peak GiB':>9}"
    )
    lines = [head]
    for i, p in enumerate(preds, 1):
        sp = f"{p.images_per_s / single.images_per_s:.2f}x" if single is not None else "-"
        lines.append(
            f"{i:>4} "
            f" {p.layout.name:<{w}}{p.images_per_s:>10,.0f}{sp:>8}{p.step_ms:>9.2f}{p.compute_ms:>9.2f}"
            f"{p.exchange_ms:>9.2f}{p.allreduce_ms:>9.2f}{p.bubble_ms:>8.2f}{p.peak_gib:>9.3f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- search
@dataclass
class Ranking:
    """What one search found: ``fits`` fastest first, ``too_big`` those over the memory limit,
    ``single`` the one-device prediction (for speedups), the links used, and the plan's own time."""

    title: str
    fits: list[Prediction]
    too_big: list[Prediction]
    single: Optional[Prediction]
    links: Links
    max_memory_gib: Optional[float]

    def table(self, top: Optional[int] = None) -> str:
        """The ranked table (the ``top`` fastest, default all), what did not fit, and the choice."""
        shown = self.fits[:top] if top else self.fits
        lines = [self.title, f"links: {self.links.source}", fmt_table(shown, self.single)]
        if len(shown) < len(self.fits):
            lines.append(f"   ... {len(self.fits) - len(shown)} slower layouts not shown (--top)")
        if self.too_big:
            lines.append(f"over --max-memory-gib {self.max_memory_gib:g}: " + ", ".join(
                f"{p.layout.name} ({p.peak_gib:.2f} GiB)" for p in self.too_big))
        if self.fits:
            lines.append("choice: " + explain(self.fits[0], self.fits[1:], self.single))
        else:
            lines.append("choice: none fits" +
                         (f" in {self.max_memory_gib:g} GiB per device; the smallest needs "
                          f"{min(p.peak_gib for p in self.too_big):.3g} GiB" if self.too_big else ""))
        return "\n".join(lines)


def search(meas: Measurements, world: int, links: Links, max_memory_gib: Optional[float],
           title: str) -> Ranking:
    """Rank every layout over ``world`` devices (``candidates``) for ``meas``'s model."""
    cfg = meas.cfg
    prof = meas.profile()
    layouts = candidates(prof, world, cfg.global_batch_size, links.gpus_per_node)
    if not layouts:
        raise ConfigError(f"no layout of {cfg.model} over {world} devices splits --global-batch-size "
                          f"{cfg.global_batch_size}: use a multiple of {world}")
    one = Layout()
    times = meas.times(batch_sizes([*layouts, one], cfg.global_batch_size))
    fits, too_big = rank(layouts, prof, times, links, cfg.global_batch_size, cfg.precision,
                                   max_memory_gib, cfg.bucket_mb)
    single = costmodel.predict(one, prof, times, links, cfg.global_batch_size, cfg.precision, cfg.bucket_mb)
    return Ranking(title, fits, too_big, single, links, max_memory_gib)


def plan_config(cfg: Config) -> Config:
    """The settings the planner measures with: the run's, the data defaulting to what the model takes
    (digits for convnet and for a user's model given them as 1 channel, which synthetic images' 3 do not
    fit; synthetic ImageNet-shaped images otherwise). The class count follows the data as in the run
    (an image or shard folder's own classes); synthetic images default to 1000."""
    keep = cfg.data != "digits" or cfg.model.startswith("convnet") or \
        (is_user_model(cfg.model) and make_source(cfg).sample_shape[0] == 1)
    data = cfg.data if keep else "synthetic"
    return Config(**{**cfg.to_dict(), "data": data,
                     "num_classes": (cfg.num_classes or 1000) if data == "synthetic" else cfg.num_classes})


# ---------------------------------------------------------------------- hooks for rayconv.run
def memory_check(cfg: Config) -> None:
    """With ``--max-memory-gib G`` and the layout known (``cfg.dp`` set), refuse a layout whose
    predicted peak memory per device exceeds G: ConfigError (exit 2) with the predicted need. The
    pipeline cut is the one given (``--stages``) or the FLOPs cut; runs on CPU, before Ray starts."""
    if cfg.max_memory_gib is None or cfg.dp is None:
        return
    need = predicted_peak_gib(cfg)
    if need > cfg.max_memory_gib:
        raise ConfigError(
            f"layout {Layout.from_config(cfg).name} needs {need:.3g} GiB per device (predicted: "
            f"parameters, gradients, momentum, activations of the micro-batches in flight) but "
            f"--max-memory-gib is {cfg.max_memory_gib:g}: raise it, use more devices (--dp/--pp/--fs), "
            f"or lower --global-batch-size (python -m rayconv.plan lists the layouts that fit)")


def predicted_peak_gib(cfg: Config) -> float:
    """The cost model's peak memory (GiB) of the fullest actor of ``cfg``'s layout (``cfg.dp`` set), with
    the pipeline cut given (``--stages``) or the FLOPs cut; the model is profiled on CPU."""
    meas = Measurements(plan_config(cfg), "cpu", use_cluster=False)
    meas.state["profile"] = profile_of(meas.cfg_dict)
    prof = meas.profile()
    chunks = None
    if cfg.stages and cfg.plan == "none":
        edges = [0, *[int(c) for c in cfg.stages.split(",") if c.strip()], prof.num_layers]
        chunks = list(zip(edges, edges[1:]))
    return peak_gib(Layout.from_config(cfg), prof, cfg.global_batch_size, cfg.precision, chunks)


def choose_layout(cfg: Config, log=print) -> tuple[Config, dict]:
    """``--layout auto``: rank the layouts over the cluster's devices and pick the fastest that fits
    ``--max-memory-gib``. Returns (``cfg`` with that layout, validated; the prediction,
    ``Prediction.as_dict``). Raises ConfigError when none fits (with the smallest predicted need)."""
    if cfg.resume:
        raise ConfigError("--layout auto picks a layout anew but --resume continues the checkpoint's: drop "
                          "--layout auto when resuming")
    connect(cfg.address, min_cpus=None)
    kind, slots = available_devices(cfg.device)
    world = slots if kind == "cuda" else max(1, slots // cfg.num_cpus_per_actor)
    meas = Measurements(plan_config(cfg), kind, use_cluster=kind == "cuda", log=log)
    meas.load()
    t0 = time.perf_counter()
    ranking = search(meas, world, meas.links(world), cfg.max_memory_gib,
                     f"--layout auto: {cfg.model}, global batch {cfg.global_batch_size}, "
                     f"{world} x {meas.state['device']}")
    meas.save()
    if not ranking.fits:
        raise ConfigError(ranking.table().splitlines()[-1].replace("choice: ", "--layout auto: ") +
                          ": raise --max-memory-gib or lower --global-batch-size")
    best = ranking.fits[0]
    # layout "manual": config.json records the chosen layout, so that a re-run or resume runs the same one
    chosen = dataclasses.replace(cfg, **best.settings(), device=kind, layout="manual", stages=",".join(
        str(a) for a, _ in best.stages[1:]) if best.layout.pp > 1 else None).validate()
    reused = f"\n{meas.reused}" if meas.reused else ""
    log(f"{ranking.table()}\n(planned in {time.perf_counter() - t0:.2f} s"
        f"{'; measured ' + ', '.join(meas.measured) if meas.measured else ', from the cache'}){reused}")
    return chosen, {**best.as_dict(), "links": ranking.links.source, "device": meas.state["device"]}


def compare(prediction: dict, summary: dict) -> dict:
    """The prediction beside the measurement, for summary.json."""
    peaks = [a.get("peak_gib") for a in summary.get("actors", [])]
    measured_peak = max(peaks) if peaks and all(p is not None for p in peaks) else None
    return {"predicted": prediction, "predicted_images_per_s": prediction["images_per_s"],
            "measured_images_per_s": summary.get("images_per_s"),
            "predicted_peak_gib": prediction["peak_gib"], "measured_peak_gib": measured_peak}


__all__ = ["candidates", "batch_sizes", "rank", "explain", "fmt_table", "Ranking", "search", "memory_check",
           "predicted_peak_gib", "choose_layout", "compare", "plan_config", "MACHINES"]
