"""The code's own rules, read from the source with ``ast`` (nothing imported): no import circle among
rayconv's modules, no module over 400 lines, and no measured figure in a docstring or help string
(measured figures live in benchmarks/RESULTS.md only)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rayconv"
MAX_LINES = 400


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (a package's ``__init__`` named
    as the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, tree: ast.AST, known: dict[str, Path]) -> set[str]:
    """The package's own modules that module ``name`` imports, at the top or inside a function (an
    import of one's own parent package is left out: it runs first whatever the child does)."""
    is_package = path.name == "__init__.py"

    def owner(dotted: str):  # the module that defines a dotted name: the longest known prefix
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            targets += [f"{base}.{a.name}" for a in node.names]
    own = {owner(t) for t in targets} - {None, name}
    return {m for m in own if not name.startswith(m + ".")}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imported(m, p, ast.parse(p.read_text()), known) for m, p in known.items()}


def circle(graph: dict[str, set[str]]):
    """One import circle as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_import_graph_finds_a_circle_and_the_parent_package_rule(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import g\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b  # function-local counts too\n")
    (pkg / "sub" / "b.py").write_text("from pkg.sub import c\nfrom .. import a\nimport os\n")
    (pkg / "sub" / "c.py").write_text("import pkg.sub\n")  # its own parent package: not an edge
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c", "pkg.a"}
    assert graph["pkg.sub.c"] == set()
    assert circle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    (pkg / "a.py").write_text("import os\n")
    assert circle(import_graph(pkg)) is None


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "rayconv.run" in graph and "rayconv.config" in graph["rayconv.flags"]
    found = circle(graph)
    assert found is None, "import circle: " + " -> ".join(found)


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in modules().values()
            if (n := p.read_text().count("\n")) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# What a measured figure looks like in prose: a ratio (0.98x), a rate (6,900 images/s, 290 GB/s
# reached), a time of a step, a result on a named GPU ("on an H200", "on 2 x H200"); ``code`` (an
# example of a format) is left out.
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b(?! ?\d)|\b\d[\d,.]* images/s|\b[Oo]n (an?|one|two|\d+ x) H[12]00s?\b"
                    r"|\b\d+(\.\d+)? ?(ms|s) (a|per) step\b|\babout \d+(\.\d+)? ?(s|ms|seconds|minutes)\b")


def texts(tree: ast.AST):
    """(line, text) of every docstring and every ``help=`` / ``"help":`` string of a module."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc
        helps = []
        if isinstance(node, ast.Call):
            helps = [k.value for k in node.keywords if k.arg in ("help", "description")]
        elif isinstance(node, ast.Dict):
            helps = [v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant) and k.value == "help"]
        for h in helps:
            parts = [c.value for c in ast.walk(h) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            yield h.lineno, "".join(parts)


def test_the_figure_pattern():
    for measured in ("trained at 0.98x its rate", "reached 6,900 images/s", "measured on an H200",
                     "on 2 x H200 it failed", "a 37 ms a step", "about 4 s of CPU"):
        assert FIGURE.search(measured), measured
    for plain in ("a 2x2 grid", "images/s per core", "the H200 datasheet", "NVLink 4 on H100/H200", "3 x 224 x 224", "25 MB buckets"):
        assert not FIGURE.search(plain), plain


def test_no_measured_figure_in_a_docstring_or_help_string():
    found = []
    for path in modules().values():
        for line, text in texts(ast.parse(path.read_text())):
            prose = re.sub(r"``.*?``", "", text, flags=re.S)
            found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0)!r}" for m in FIGURE.finditer(prose)]
    assert not found, "measured figures belong in benchmarks/RESULTS.md: " + "; ".join(found)
