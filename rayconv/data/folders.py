"""What an ImageNet-layout folder holds and what is skipped, for ``--data imagefolder`` and
``python -m rayconv.prepare`` alike.

Layout: ``<dir>/train/<class>/<images>`` and ``<dir>/val/<class>/<images>``; class folders are the
sub-folders of ``train`` (``val`` must have the same ones). Image files are those with one of
torchvision's ImageFolder suffixes (``IMAGE_SUFFIXES``). Folders and files whose names start with a dot
are not data (``hidden``): neither classes nor images nor skipped. Other files, and directories named
like an image, are skipped and counted (``scan``, ``warn_skipped``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rayconv.errors import DataError

# torchvision's ImageFolder suffixes (torchvision.datasets.folder.IMG_EXTENSIONS;
# tests/unit/test_light_imports.py
# checks they are the same). Written out so that importing this module does not import torchvision.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = {"train": "train", "test": "val"}   # Source's split name -> the folder's


def hidden(name: str) -> bool:
    """Folders and files whose names start with a dot (``.thumbnails``, macOS's ``._x.jpg``) are not
    data: neither classes nor images."""
    return name.startswith(".")


def scan(root: Path) -> tuple[list[str], dict[str, list[tuple[str, int]]], dict[str, list[dict[str, str]]]]:
    """(classes, {split: [(relative path, label)]}, {split: [skipped {path, reason}]}) of an ImageNet-
    layout folder, files in sorted order. Raises DataError for a missing split, no classes, val classes
    other than train's, or a class folder without image files."""
    def class_dirs(split_dir: Path) -> list[str]:
        if not split_dir.is_dir():
            raise DataError(
                f"{split_dir} does not exist: DIR must hold train/<class>/<images> and val/<class>/<images> "
                "(JPEG, PNG or another format of torchvision's ImageFolder)")
        return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not hidden(p.name))

    classes = class_dirs(root / "train")
    if not classes:
        raise DataError(f"{root / 'train'} has no class folders: put images in {root}/train/<class>/")
    files: dict[str, list[tuple[str, int]]] = {}
    skipped: dict[str, list[dict[str, str]]] = {}
    for split in SPLITS.values():
        found = class_dirs(root / split)
        if found != classes:
            raise DataError(f"{root / split} has classes {found[:5]}... but train has {classes[:5]}...: "
                            "both need the same class folders")
        files[split], skipped[split] = [], []
        for label, name in enumerate(classes):
            images, bad = _walk(root / split / name, root)
            files[split] += [(rel, label) for rel in images]
            skipped[split] += bad
            if not images:
                raise DataError(f"class folder {root / split / name} has no image files "
                                f"({', '.join(IMAGE_SUFFIXES)}): add images or remove the folder")
    return classes, files, skipped


def _walk(folder: Path, root: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(image files, skipped entries {path, reason}) under ``folder`` (links followed, sorted), paths
    relative to ``root``: files with an image suffix; skipped: other files and directories named like
    an image. Hidden folders and files (``hidden``) are left out, neither images nor skipped, as
    ``--data imagefolder`` leaves them out."""
    images, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not hidden(d))
        rel = Path(dirpath).relative_to(root)
        skipped += [{"path": str(rel / d), "reason": "a directory, not an image file"}
                    for d in dirnames if Path(d).suffix.lower() in IMAGE_SUFFIXES]
        for f in sorted(f for f in filenames if not hidden(f)):
            if Path(f).suffix.lower() in IMAGE_SUFFIXES:
                images.append(str(rel / f))
            else:
                skipped.append({"path": str(rel / f), "reason": "not an image file (suffix)"})
    return images, skipped


def empty_class_folders(split_dir: Path) -> list[str]:
    """The class folders of ``split_dir`` (sorted names) that hold no image file at any depth."""
    return [c.name for c in sorted(split_dir.iterdir()) if c.is_dir() and not hidden(c.name)
            and not _walk(c, split_dir)[0]]


def warn_skipped(split_dir: Path, log=None) -> int:
    """For ``--data imagefolder``: one warning line naming the count and the first few entries of
    ``split_dir``'s class folders that torchvision's ImageFolder leaves out (files without an image
    suffix, directories named like an image); returns the count."""
    skipped = [x for c in sorted(split_dir.iterdir()) if c.is_dir() and not hidden(c.name)
               for x in _walk(c, split_dir.parent)[1]]
    if skipped:
        names = ", ".join(f"{b['path']} ({b['reason']})" for b in skipped[:3])
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"rayconv: warning: {split_dir}: skipped {len(skipped)} entries that are not image files (first:"
            f" {names})"
        )
    return len(skipped)


def check_image_folder(path: Path) -> None:
    """Raise DataError unless ``path`` holds class folders with at least one image file (hidden
    folders and files, ``hidden``, do not count)."""
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist: --data-dir must hold train/<class>/<images> "
                        f"and val/<class>/<images> ({', '.join(IMAGE_SUFFIXES)})")
    classes = [p for p in path.iterdir() if p.is_dir() and not hidden(p.name)]
    if not classes:
        raise DataError(f"data folder {path} has no class folders: put images in {path}/<class>/")
    if not any(f.suffix.lower() in IMAGE_SUFFIXES and not hidden(f.name) for c in classes
               for f in c.iterdir()):
        raise DataError(f"data folder {path} has class folders but no image files "
                        f"({', '.join(IMAGE_SUFFIXES)})")


def visible_image_folder(root: str, transform):
    """torchvision's ImageFolder over ``root`` that skips hidden folders and files (``hidden``) at every
    level. Raises FileNotFoundError (torchvision's) for a class folder without image files."""
    from torchvision.datasets import ImageFolder   # (torchvision's import takes seconds: only when used)
    from torchvision.datasets.folder import has_file_allowed_extension

    class VisibleImageFolder(ImageFolder):
        def find_classes(self, directory):
            classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not hidden(e.name))
            if not classes:
                raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
            return classes, {c: i for i, c in enumerate(classes)}

        @staticmethod
        def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
            def visible_image(path: str) -> bool:
                return (has_file_allowed_extension(path, extensions or IMAGE_SUFFIXES)
                        and not any(hidden(part) for part in Path(path).relative_to(directory).parts))

            return ImageFolder.make_dataset(directory, class_to_idx, None, visible_image, allow_empty)

    return VisibleImageFolder(root, transform=transform)
