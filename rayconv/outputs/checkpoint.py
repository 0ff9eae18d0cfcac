"""Checkpoints of a run: find the one ``--resume`` means, read and verify it, write its manifest.

``<out>/checkpoints/step-<k>/`` holds one file per actor (``rank-<r>.pt``: its parameters and buffers
keyed as in ``Actor.model_state()``, its optimizer state_dict with its parameters' names, the keys filter
split sliced, RNG states; ``actor/state.py``), ``metrics.parquet`` (the rows
so far) and ``manifest.json`` (step, layout, config, data and lr-schedule position, model, files with
sizes and sha256). It is written into ``step-<k>.tmp/`` and renamed only when every file is written and
fsynced: a crash mid-write leaves the previous checkpoint as it was. Everything loads with
``weights_only=True`` (by the actors; this module handles the files as bytes and imports no torch, so
that ``python -m rayconv.run --resume`` reads a checkpoint's settings before torch is loaded).

A run folder in an object store (``--out s3://bucket/runs/r1``: a ``storage.Location``, which these
functions take wherever they take a Path) has no rename: there the files go straight into
``step-<k>/``, the manifest last, and a ``step-<k>/`` without a manifest is incomplete (never listed,
never resumed; ``remove_partial`` deletes it). A checkpoint written again at its step loses its
manifest first.

Two forms of rank files are read (the manifest's ``format``): 2, written by the actors themselves in
the background (``actor/saver.py``), each holding its actor's skeleton and the tensors dealt to it, one
copy of each tensor over the data-parallel replicas (``outputs/rank_files.py``), straight into ``step-<k>/``
on a disk too, where the driver then writes ``metrics.parquet`` and the manifest (``write_manifest``)
once every actor reported its file's size and sha256; and 1, whole actor states passed through the
driver (``write_checkpoint``). A ``step-<k>/`` without a manifest is incomplete on a disk too.

Assembling the actors' parts into one ``model.pt`` is ``export.py``'s; joining a checkpoint's rank
files into the whole state that another layout's actors cut their parts from is ``reshard.py``'s
(``whole_state`` reads it without Ray).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rayconv.errors import CheckpointError, ConfigError
from rayconv.files import fsync_dir, sha256, write_synced
from rayconv.storage import Location, Place, place, remove, storage_errors
from rayconv.storage_checks import check_readable

FORMAT = 1          # rank files of whole actor states, written by the driver
RANK_FILE_FORMAT = 2     # rank files written by the actors, one copy of each tensor (outputs/rank_files.py)
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
WHOLE_STATE_ARG = "whole_state's path"   # (how a checkpoint's messages name whole_state's argument)
_OTHER_LAYOUT: set[Any] = set()  # checkpoint folders check_resumable found saved under another layout


def _place(p: str | Path | Location, flag: str = "--resume") -> Place:
    return p if isinstance(p, (Path, Location)) else place(p, flag=flag)


def _another(flag: str) -> str:
    """What a refused checkpoint's message asks for: of ``--resume``, another checkpoint to resume from;
    of a Python caller's argument (``flag``: ``whole_state's path``), another checkpoint to pass."""
    return "resume from another checkpoint" if flag == "--resume" else "give another checkpoint"


def list_checkpoints(out: Place) -> list[Place]:
    """Complete checkpoints of a run folder (``step-<k>`` with a manifest), oldest first."""
    root = _place(out) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def check_resumes_newest(resume: Checkpoint, out: Place) -> None:
    """Refuse resuming in place from a checkpoint older than the run folder's newest: ``out`` being
    ``resume``'s run folder, the run would write steps that checkpoints after ``resume.step`` hold.
    Raises CheckpointError naming what to give instead."""
    if out.resolve() != resume.run_dir.resolve():
        return
    newer = [p.name for p in list_checkpoints(out) if int(p.name.split("-")[1]) > resume.step]
    if newer:
        raise CheckpointError(f"--resume {resume.path} is older than {', '.join(newer)} of the same run: "
                              "resume from the newest, or give --out NEW to branch off from step "
                              f"{resume.step}")


def latest_checkpoint(out: Place) -> Optional[Place]:
    found = list_checkpoints(out)
    return found[-1] if found else None


def remove_partial(out: Place, below: Optional[int] = None) -> list[str]:
    """Delete unfinished checkpoints: ``step-<k>.tmp`` folders, and ``step-<k>`` folders without a
    manifest (rank files written for a checkpoint that never completed: an interrupted write, an upload
    that failed), only those of steps below ``below`` where given (a newer one may be being written).
    Returns the names removed."""
    root = _place(out) / "checkpoints"
    gone = []
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_DIR.match(p.name)
            if p.name.endswith(".tmp") or (m and (below is None or int(m.group(1)) < below)
                                           and not (p / MANIFEST).is_file()):
                remove(p)
                gone.append(p.name)
    return gone


def step_folders(out: Place) -> set[int]:
    """The steps of every ``step-<k>`` folder of ``out``'s checkpoints, complete or not (one listing)."""
    root = _place(out) / "checkpoints"
    if not root.is_dir():
        return set()
    return {int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name))}


def write_manifest(folder: Place, step: int, manifest: dict[str, Any], files: list[dict[str, Any]],
                   extra: Optional[dict[str, bytes]] = None) -> None:
    """Complete the checkpoint in ``folder`` (format 2), whose rank files the actors wrote and listed
    in ``files`` ({name, bytes, sha256}): the ``extra`` files (each whole or absent), then
    ``manifest.json``, last."""
    listed = list(files)
    for name, data in (extra or {}).items():
        _write_whole(folder / name, data)
        listed.append({"name": name, "bytes": len(data), "sha256": sha256(data)})
    body = {**manifest, "format": RANK_FILE_FORMAT, "step": step, "files": listed}
    _write_whole(folder / MANIFEST, (json.dumps(body, indent=2) + "\n").encode())
    if isinstance(folder, Path):
        fsync_dir(folder)


def _write_whole(f: Place, data: bytes) -> None:
    if isinstance(f, Path):
        write_synced(f.with_name(f.name + ".tmp"), data)
        os.replace(f.with_name(f.name + ".tmp"), f)
    else:
        f.write_bytes(data)


def prune(out: Place, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints of ``out`` (0: all); older ones are deleted."""
    if keep > 0:
        for p in list_checkpoints(out)[:-keep]:
            remove(p)


def write_checkpoint(out: Place, step: int, rank_files: list[bytes], manifest: dict[str, Any],
                     extra: Optional[dict[str, bytes]] = None, keep: int = 0) -> Place:
    """Write ``checkpoints/step-<step>/`` atomically: ``rank-<r>.pt`` from ``rank_files[r]``, the ``extra``
    files, then ``manifest.json`` listing them; rename the folder into place (in a store: written in
    place, the manifest last); keep the newest ``keep`` checkpoints (0: all). Returns the checkpoint
    folder."""
    if isinstance(out, Location):
        return _write_in_store(out, step, rank_files, manifest, extra, keep)
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = []
    for name, data in [*((f"rank-{r}.pt", b) for r, b in enumerate(rank_files)), *(extra or {}).items()]:
        write_synced(tmp / name, data)
        files.append({"name": name, "bytes": len(data), "sha256": sha256(data)})
    write_synced(tmp / MANIFEST, (json.dumps({**manifest, "format": FORMAT, "step": step, "files": files},
                                              indent=2) + "\n").encode())
    fsync_dir(tmp)
    old = None
    if final.exists():  # the same step written again (a run resumed from an older checkpoint)
        old = root / f"step-{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep > 0:
        for p in list_checkpoints(out)[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def _write_in_store(out: Location, step: int, rank_files: list[bytes], manifest: dict[str, Any],
                    extra: Optional[dict[str, bytes]], keep: int) -> Location:
    """``write_checkpoint`` into an object store: each object one PUT, the manifest last (module
    docstring)."""
    final = out / "checkpoints" / f"step-{step}"
    with storage_errors(final, "--out", "cannot be written"):
        (final / MANIFEST).unlink(missing_ok=True)   # (the same step written again: incomplete until done)
        files = []
        for name, data in [*((f"rank-{r}.pt", b) for r, b in enumerate(rank_files)), *(extra or {}).items()]:
            (final / name).write_bytes(data)
            files.append({"name": name, "bytes": len(data), "sha256": sha256(data)})
        whole = {**manifest, "format": FORMAT, "step": step, "files": files}
        (final / MANIFEST).write_bytes((json.dumps(whole, indent=2) + "\n").encode())
        if keep > 0:
            for p in list_checkpoints(out)[:-keep]:
                remove(p)
    return final


@dataclass
class Checkpoint:
    """A verified checkpoint: its folder, manifest and file contents (sizes and sha256 checked)."""

    path: Place
    manifest: dict[str, Any]
    files: dict[str, bytes]
    _whole: Optional[bytes] = field(default=None, repr=False)
    _payloads: Optional[list] = field(default=None, repr=False)

    @property
    def step(self) -> int:
        """Steps done; the run continues at this step."""
        return int(self.manifest["step"])

    @property
    def run_dir(self) -> Place:
        return self.path.parent.parent

    @property
    def layout(self) -> dict[str, Any]:
        return self.manifest["layout"]

    def payloads(self) -> list[dict[str, Any]]:
        """Every rank's whole state (``actor.state.rank_payload``'s form), in rank order, made once."""
        if self._payloads is None:
            from rayconv.outputs.rank_files import payloads_of  # (torch: loaded once a run is set up)
            self._payloads = payloads_of(self.files, self.layout)
        return self._payloads

    def rank_file(self, rank: int) -> bytes:
        """Rank ``rank``'s whole state as ``torch.save`` bytes (what ``load_rank_file`` reads)."""
        if self.manifest.get("format", FORMAT) == FORMAT:
            return self.files[f"rank-{rank}.pt"]
        import io
        import torch
        buf = io.BytesIO()
        torch.save(self.payloads()[rank], buf)
        return buf.getvalue()

    def whole(self) -> bytes:
        """The rank files joined into the whole model's state (``reshard.join``) as ``torch.save``
        bytes, made once. Raises CheckpointError if they cannot be joined."""
        if self._whole is None:
            from rayconv.outputs.reshard import whole_blob  # (torch: loaded once a run is set up)
            self._whole = whole_blob(self.payloads(), self.layout)
        return self._whole


def find_checkpoint(path: str | Path | Location, flag: str = "--resume") -> Place:
    """The checkpoint folder that ``--resume path`` means: ``path`` (a local path, or a URI:
    ``s3://bucket/runs/r1``) itself if it holds a manifest, else the newest complete checkpoint of the
    run folder ``path``. ``flag``: how the messages name the argument (a Python caller's: ``whole_state's
    path``). Raises CheckpointError, StorageError (a store that cannot be read)."""
    p = _place(path, flag)
    if isinstance(p, Location):
        check_readable(p, flag)
        with storage_errors(p, flag):
            return _find(p, path, flag)
    return _find(p, path, flag)


def _find(p: Place, path: Any, flag: str) -> Place:
    if not p.exists():
        raise CheckpointError(f"{flag} {path}: no such folder: give a run folder (with checkpoints/) "
                              "or one of its checkpoints/step-<k> folders")
    if not p.is_dir():
        raise CheckpointError(
            f"{flag} {path} is a file: give a run folder or a checkpoints/step-<k> folder")
    if (p / MANIFEST).is_file():
        return p
    if STEP_DIR.match(p.name[:-4] if p.name.endswith(".tmp") else p.name):
        again = "resume from" if flag == "--resume" else "give"
        raise CheckpointError(f"{flag} {path} is a checkpoint that was never finished (no {MANIFEST}): "
                              f"{again} its run folder {p.parent.parent} instead")
    newest = latest_checkpoint(p)
    if newest is None:
        raise CheckpointError(f"{flag} {path} holds no complete checkpoint (no "
                              f"checkpoints/step-<k>/{MANIFEST}): a run writes them with --checkpoint-every "
                              "N")
    return newest


def saved_config(resume: str) -> dict[str, Any]:
    """The settings (``Config.to_dict()``) saved in the checkpoint that ``--resume resume`` names.
    Raises CheckpointError (no such checkpoint) or ConfigError (its manifest cannot be read)."""
    ckpt = find_checkpoint(resume)
    try:
        return dict(json.loads(_read(ckpt / MANIFEST).decode())["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {resume}: {ckpt / MANIFEST} cannot be read ({e}): "
                          "resume from another checkpoint") from None


def _read(f: Place, flag: str = "--resume") -> bytes:
    if isinstance(f, Location):
        with storage_errors(f, flag):
            return f.read_bytes()
    return f.read_bytes()


def load_checkpoint(path: str | Path | Location, flag: str = "--resume") -> Checkpoint:
    """Find, read and verify a checkpoint (every listed file present, of its size and sha256), on
    the disk or in a store (a URI); ``flag`` as ``find_checkpoint``'s. Raises CheckpointError naming the
    file at fault, StorageError."""
    ckpt = find_checkpoint(path, flag)
    another = _another(flag)
    try:
        manifest = json.loads(_read(ckpt / MANIFEST, flag).decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} cannot be read ({e}): {another}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, RANK_FILE_FORMAT) \
            or "files" not in manifest:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is not a rayconv checkpoint manifest (format "
                              f"{FORMAT}): {another}, one written by --checkpoint-every")
    files: dict[str, bytes] = {}
    for entry in manifest["files"]:
        f = ckpt / entry["name"]
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing: {another}")
        data = _read(f, flag)
        if len(data) != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or damaged ({len(data)} bytes, the "
                                  f"manifest says {entry['bytes']}): {another}")
        if sha256(data) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt (sha256 differs from the manifest): "
                                  f"{another}")
        files[entry["name"]] = data
    return Checkpoint(ckpt, manifest, files)


def whole_state(path: str | Path | Location) -> dict[str, Any]:
    """The whole state of a checkpoint (a ``step-<k>`` folder, or a run folder's newest; a local path
    or a URI such as ``s3://bucket/runs/r1``), every file
    verified: ``["model"]`` is the model's state_dict (``load_state_dict`` of the model's builder),
    ``["optimizer"]["state"]`` each parameter's optimizer state by its name, ``["ema"]`` the moving
    average or None (``reshard.join``), ``["step"]`` the steps done when it was written. Needs no Ray.
    Raises CheckpointError (its message names the argument as ``whole_state's path``), StorageError."""
    import io
    import torch
    ckpt = load_checkpoint(path, flag=WHOLE_STATE_ARG)
    state = torch.load(io.BytesIO(ckpt.whole()), map_location="cpu", weights_only=True)
    state["step"] = ckpt.step
    return state


def check_resumable(ckpt: Checkpoint, cfg: Any, mesh: Any, stages: list, num_classes: int,
                    sample_shape: tuple[int, ...]) -> None:
    """Refuse a checkpoint of another model or data shape. Any layout loads it: under the one it was
    saved with each actor loads its own rank file; under another (dp, pp cut or schedule, fs, --plan)
    the rank files are joined here (``reshard.join``, refused with one line if they cannot be), so
    that each actor cuts its part from the whole state (``rank_file_for``)."""
    m = ckpt.manifest
    if m["model"] != cfg.model:
        raise CheckpointError(f"checkpoint {ckpt.path} is of model {m['model']!r} but this run asks for "
                              f"--model {cfg.model}: resume with --model {m['model']} or start a new run")
    if m["num_classes"] != num_classes or list(m["sample_shape"]) != list(sample_shape):
        raise CheckpointError(f"checkpoint {ckpt.path} was trained on {m['num_classes']} classes of "
                              f"{tuple(m['sample_shape'])} images, this run's data has {num_classes} classes "
                              f"of {tuple(sample_shape)}: resume with the same "
                              "--data/--image-size/--num-classes")
    val_split = m.get("config", {}).get("val_split", 0.0)
    if val_split != cfg.val_split:   # (another split would train on images held out so far, or the reverse)
        raise CheckpointError(f"checkpoint {ckpt.path} trained with --val-split {val_split:g}, this run asks "
                              f"for --val-split {cfg.val_split:g}: resume with --val-split {val_split:g}")
    if same_layout(ckpt.layout, mesh, cfg.plan, stages):
        _OTHER_LAYOUT.discard(ckpt.path.resolve())
    else:
        ckpt.whole()
        _OTHER_LAYOUT.add(ckpt.path.resolve())  # (a recovery that reloads this folder cuts it again)


def same_layout(saved: dict[str, Any], mesh: Any, plan: str, stages: list) -> bool:
    """Whether a run of ``mesh``, ``plan`` and pipeline ``stages`` (its chunks under interleaved 1F1B)
    cuts the model into the parts a checkpoint of layout ``saved`` holds, rank for rank."""
    return ((saved["dp"], saved["pp"], saved["fs"], saved["plan"]) == (mesh.dp, mesh.pp, mesh.fs, plan)
            and [list(s) for s in stages] == [list(s) for s in saved["stages"]])


def rank_file_for(ckpt: Checkpoint, mesh: Any, rank: int) -> bytes:
    """What ``rank`` of ``mesh`` loads (``Actor.load_rank_file``): its own rank file when the checkpoint
    was saved under this run's layout, else (``check_resumable`` found another) the checkpoint's
    whole state, from which each actor cuts its part."""
    saved = ckpt.layout
    if ckpt._whole is None and ckpt.path.resolve() not in _OTHER_LAYOUT and \
            (saved["dp"], saved["pp"], saved["fs"]) == (mesh.dp, mesh.pp, mesh.fs):
        return ckpt.rank_file(rank)
    return ckpt.whole()
