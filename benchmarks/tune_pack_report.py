"""The lines of ``benchmarks/tune_pack.sh``: per search half (packed, sequential) its wall seconds and
where its trials' time went, the ratio of the two, and the configuration the search chose with its
validation and test accuracy.

    python benchmarks/tune_pack_report.py OUT   # OUT: tune_pack.sh's folder (walls.txt, packed/, sequential/)

Per trial, from its ``summary.json`` and ``metrics.parquet``: startup (seconds from the trial's run
call to its actors set up: ``startup.phases.actors_set_up``), evaluation (each evaluation row's
``time_s`` less that of the step before it: the actors' flush and the validation/test passes),
training (``train_time_s`` less evaluation: the steps, including Tune's hand-off at each evaluation),
end (``wall_time_s`` less the rest: loading, the final export and summary). Rows: ``OUT/report.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional


def trial_times(folder: Path) -> Optional[dict[str, float]]:
    """Startup, training, evaluation, end and wall seconds of one trial's run folder (None without a
    summary)."""
    path = folder / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    startup = (s.get("startup") or {}).get("phases", {}).get("actors_set_up") or 0.0
    evaluation = 0.0
    parquet = folder / "metrics.parquet"
    if parquet.is_file():
        import pyarrow.parquet as pq

        rows = pq.read_table(parquet, columns=["kind", "step", "time_s"]).to_pylist()
        last_train: Optional[float] = None
        for r in sorted(rows, key=lambda r: (r["step"], r["kind"] != "train")):
            if r["kind"] == "train":
                last_train = r["time_s"]
            elif r["kind"] == "eval" and last_train is not None and r["time_s"] is not None:
                evaluation += max(0.0, r["time_s"] - last_train)
    train = max(0.0, (s.get("train_time_s") or 0.0) - evaluation)
    wall = s.get("wall_time_s") or 0.0
    peaks = [a["peak_gib"] for a in s.get("actors") or [] if a.get("peak_gib") is not None]
    return {"startup_s": startup, "train_s": train, "eval_s": evaluation,
            "end_s": max(0.0, wall - startup - train - evaluation), "wall_s": wall,
            "peak_gib": max(peaks) if peaks else None}


def half(out: Path, name: str, wall: float, rc: int) -> dict[str, Any]:
    """One search's figures: its wall, its trials' rows and times, the best trial."""
    saved = out / name / "results.json"
    found = json.loads(saved.read_text()) if saved.is_file() else {"trials": [], "best": None, "metric": None}
    trials = []
    for row in found["trials"]:
        times = trial_times(Path(row["folder"])) if row.get("folder") else None
        trials.append({**row, **(times or {})})
    timed = [t for t in trials if "wall_s" in t]
    mean = (
        {
            k: sum(t[k] for t in timed) / len(timed)
            for k in ("startup_s", "train_s", "eval_s", "end_s", "wall_s")
        }
        if timed
        else {}
    )
    return {"name": name, "rc": rc, "wall_s": wall, "metric": found["metric"], "best": found["best"],
            "trials": trials, "mean": mean, "trial_wall_sum_s": sum(t["wall_s"] for t in timed),
            "peak_gib": max([t["peak_gib"] for t in timed if t.get("peak_gib") is not None], default=None)}


def lines(halves: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for h in halves.values():
        m, n = h["mean"], len(h["trials"])
        done = sum(1 for t in h["trials"] if t["status"] == "finished")
        where = (
            f"per trial mean: startup {m['startup_s']:.1f} s, training {m['train_s']:.1f} s, evaluation "
            f"{m['eval_s']:.1f} s, end {m['end_s']:.1f} s (trial wall {m['wall_s']:.1f} s); trials' walls "
            f"sum {h['trial_wall_sum_s']:.1f} s = {h['trial_wall_sum_s'] / max(1e-9, h['wall_s']):.2f}x "
            "the search's wall"
            if m
            else "no trial timings"
        )
        # (one trial at a time: the rest is Ray's start, Tune, each trial's process)
        if m and h["name"] == "sequential":
            where += f"; outside the trials' runs {h['wall_s'] - h['trial_wall_sum_s']:.1f} s"
        if h["peak_gib"] is not None:
            where += f"; largest actor peak GPU memory {h['peak_gib']:.2f} GiB"
        out.append(
            f"{h['name']}: wall {h['wall_s']:.1f} s (rc {h['rc']}), {done}/{n} trials finished; {where}")
    if "packed" in halves and "sequential" in halves:
        p, s = halves["packed"]["wall_s"], halves["sequential"]["wall_s"]
        out.append(f"packed / sequential: {p:.1f} s / {s:.1f} s = {p / max(1e-9, s):.3f} (target <= 0.6)")
    for h in halves.values():
        b = h["best"]
        if b is None:
            out.append(f"{h['name']}: chosen: none (no trial has {h['metric']})")
            continue
        params = ", ".join(f"{k} {b[k]}" for k in ("lr", "opt") if k in b)
        test = b.get("test_accuracy")
        out.append(
            f"{h['name']}: chosen by {h['metric']}: {params} ({b['trial']}): {h['metric']}"
            f" {b[h['metric']]:.4f}, test_accuracy {test:.4f}"
            if test is not None
            else f"{h['name']}: chosen {params}: no test accuracy"
        )
    for h in list(halves.values())[:1]:   # the first half's trials, one line each
        for t in h["trials"]:
            val = t.get(h["metric"])
            out.append(
                f"  {h['name']} {t['trial']}: lr {t.get('lr')} opt {t.get('opt')}: {h['metric']} "
                f"{'-' if val is None else f'{val:.4f}'}, {t['status']}, wall {t.get('wall_s', 0):.1f} s")
    return out


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    halves: dict[str, dict[str, Any]] = {}
    for line in (out / "walls.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in ("packed", "sequential"):
            halves[parts[0]] = half(out, parts[0], float(parts[2]), int(parts[1]))
    text = lines(halves)
    print("\n".join(text))
    (out / "report.json").write_text(json.dumps({"lines": text, "halves": halves}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
