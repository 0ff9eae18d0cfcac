"""A component that takes its section of the settings says so: a parameter annotated with a section of
``rayconv.settings`` (``RecipeSettings``, ``DataSettings``, ...) reads only that section's fields, so the
annotation tells which settings the component depends on. ``Config`` inherits every section, so callers
pass the run's settings as they are."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import rayconv.settings as settings

PACKAGE = Path(__file__).resolve().parents[2] / "rayconv"
SECTIONS = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in vars(settings).items()
            if isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and cls.__module__ == settings.__name__}


def misreads(source: str) -> list[tuple[str, str, str, str]]:
    """(function, parameter, section, field) for each attribute read off a section-annotated parameter
    that is not a field of that section (methods of the section, ``validate`` and the like, excepted)."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            section = ast.unparse(arg.annotation).strip("'\"") if arg.annotation is not None else ""
            if section not in SECTIONS:
                continue
            cls = getattr(settings, section)
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id == arg.arg and node.attr not in SECTIONS[section] \
                        and not callable(getattr(cls, node.attr, None)):
                    out.append((fn.name, arg.arg, section, node.attr))
    return out


def test_the_check_finds_a_field_of_another_section():
    source = ("def f(cfg: RecipeSettings, d: 'DataSettings'):\n    return cfg.lr, cfg.device, d.data_dir, "
              "d.lr\n")
    assert misreads(source) == [("f", "cfg", "RecipeSettings", "device"), ("f", "d", "DataSettings", "lr")]


def test_a_parameter_annotated_with_a_section_reads_only_its_fields():
    annotated = 0
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        annotated += sum(f"cfg: {s}" in source for s in SECTIONS if s not in ("LayoutFields",))
        bad += [(str(path.relative_to(PACKAGE.parent)), *m) for m in misreads(source)]
    assert not bad, bad
    assert annotated >= 8   # (the components that read one section say so: lr, optimizer, data cache, ...)
