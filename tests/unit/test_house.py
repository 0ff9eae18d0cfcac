"""The code's own rules, read from the source with ``ast`` (nothing imported): no import circle among
rayconv's modules, no module over 400 lines, no line over 110 characters, no module importing another
module's underscored name, every module named in docs/architecture.md's code map, and no measured figure in
a docstring or help string (measured figures live in benchmarks/RESULTS.md only, a report of at most 400
lines whose prose names no commit: git holds the history); and the tests' own: each test module stands
alone (no hook orders the modules, none imports another, no test changes what a module-scoped fixture
built)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rayconv"
MAX_LINES = 400
RESULTS = REPO / "benchmarks" / "RESULTS.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"


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
    def owner(dotted: str):  # the module that defines a dotted name: the longest known prefix
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets += [f"{absolute(name, path, node)}.{a.name}" for a in node.names]
    own = {owner(t) for t in targets} - {None, name}
    return {m for m in own if not name.startswith(m + ".")}


def absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The dotted module an ``ImportFrom`` of module ``name`` (file ``path``) reads from."""
    if not node.level:
        return node.module or ""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    here = here[: len(here) - (node.level - 1)]
    return ".".join(here + ([node.module] if node.module else []))


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


def test_actors_are_got_and_given_back_only_through_the_seam():
    """Outside rayconv/cluster/, no module imports the kept actors' machinery (``cluster.pool``,
    ``cluster.across``) or starts actors itself (``reserve``, ``create_actors``): a run gets and gives
    back its actors through ``cluster.acquire`` alone (docs/architecture.md, "Getting actors")."""
    behind, starts = {"rayconv.cluster.pool", "rayconv.cluster.across"}, {"reserve", "create_actors"}
    found = []
    for name, imports in import_graph().items():
        if name == "rayconv.cluster" or name.startswith("rayconv.cluster."):
            continue
        found += [f"{name} imports {m}" for m in sorted(imports & behind)]
        path = modules()[name]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and absolute(name, path, node).startswith("rayconv.cluster"):
                found += [f"{name} imports {a.name}" for a in node.names if a.name in starts]
    assert not found, "; ".join(found)


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in modules().values()
            if (n := p.read_text().count("\n")) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


MAX_WIDTH = 110
CODE_FOLDERS = ("rayconv", "tests", "benchmarks", "examples")


def test_no_line_over_110_characters():
    """Lines of rayconv/, tests/, benchmarks/ and examples/ stay within 110 characters, so that no
    statements are joined to pass the 400-line signal."""
    long = [f"{path.relative_to(REPO)}:{n}" for folder in CODE_FOLDERS
            for path in sorted((REPO / folder).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_WIDTH]
    assert not long, f"{len(long)} lines over {MAX_WIDTH} characters (split them): {', '.join(long[:10])}"


# What a measured figure looks like in prose: a ratio (0.98x), a rate (6,900 images/s, 290 GB/s
# reached), a time of a step, a result on a named GPU ("on an H200", "on 2 x H200"); ``code`` (an
# example of a format) is left out.
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b(?! ?\d)|\b\d[\d,.]* images/s|\b[Oo]n (an?|one|two|\d+ x) H[12]00s?\b"
                    r"|\b\d+(\.\d+)? ?(ms|s) (a|per) step\b|\babout \d+(\.\d+)? ?(s|ms|seconds|minutes)\b"
                    # a link's rate as measured, reached or assumed achieved (a datasheet's rate is a source)
                    r"|\b\d+(\.\d+)? ?G[Bb](it)?/s,? (assumed|achieved|reached|measured)\b"
                    r"|\b(assumed?s?|achieved|reached|reaches|measured|measures)( at)? \d+(\.\d+)? ?"
                    r"G[Bb](it)?/s")


def texts(tree: ast.AST, source: str = ""):
    """(line, text) of every docstring, every ``help=`` / ``"help":`` string, every other string constant
    (not an f-string's: its figures are computed) and every comment of a module (``source``: its text)."""
    in_fstrings = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in ast.walk(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            yield node.lineno, node.value
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc
        helps = []
        if isinstance(node, ast.Call):
            helps = [k.value for k in node.keywords if k.arg in ("help", "description")]
        elif isinstance(node, ast.Dict):
            helps = [v for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant) and k.value == "help"]
        for h in helps:
            parts = [c.value for c in ast.walk(h) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            yield h.lineno, "".join(parts)
    if source:
        yield from ((t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT)


def test_the_figure_pattern():
    for measured in ("trained at 0.98x its rate", "reached 6,900 images/s", "measured on an H200",
                     "on 2 x H200 it failed", "a 37 ms a step", "about 4 s of CPU",
                     "290 GB/s assumed achieved", "the table assumes 290 GB/s", "(assumed 1 GB/s, 0.1 ms)",
                     "NCCL reached 268 GB/s"):
        assert FIGURE.search(measured), measured
    for plain in ("a 2x2 grid", "images/s per core", "the H200 datasheet", "NVLink 4 on H100/H200",
                  "3 x 224 x 224", "25 MB buckets", "GB/s assumed achieved"):
        assert not FIGURE.search(plain), plain


def test_no_measured_figure_in_a_docstring_help_string_or_comment():
    found = []
    for path in modules().values():
        source = path.read_text()
        for line, text in texts(ast.parse(source), source):
            prose = re.sub(r"``.*?``", "", text, flags=re.S)
            found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0)!r}"
                      for m in FIGURE.finditer(prose)]
    assert not found, "measured figures belong in benchmarks/RESULTS.md: " + "; ".join(sorted(set(found)))


# --- no module reaches for another module's underscored name ------------------------------------------

def underscored_imports(root: Path = PACKAGE) -> list[str]:
    """``file:line: module._name`` for every use of another module's underscored name (``_x``, not
    ``__x__``): ``from m import _x`` and ``m._x`` where ``m`` is bound to a module of the package by an
    import (``import pkg.m as m``, ``from pkg import m``), at the top or inside a function."""
    known = modules(root)
    private = re.compile(r"_(?!_)\w*$")
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # a local name -> the package's module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known:
                        top = a.name.partition(".")[0]  # ``import pkg.m`` binds ``pkg``
                        bound[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom):
                base = absolute(name, path, node)
                for a in node.names:
                    if f"{base}.{a.name}" in known:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in known and base != name and private.match(a.name):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {base}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private.match(node.attr):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in bound:
                    owner = ".".join([bound[value.id], *reversed(chain)])
                    if owner in known and owner != name:
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {owner}.{node.attr}")
    return sorted(set(found))


def test_the_underscore_check_finds_both_forms(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_hidden = 1\npublic = 2\n__all__ = []\nprint(_hidden)\n")
    (pkg / "sub" / "b.py").write_text("from pkg.a import public, __all__\nimport pkg.a\n"
                                      "def f():\n    from .. import a\n    return a.public, pkg.a.public\n")
    assert underscored_imports(pkg) == []
    (pkg / "sub" / "b.py").write_text("from ..a import _hidden\nimport pkg.a as m\n"
                                      "def f():\n    from pkg import a\n    return a._hidden, m._hidden\n")
    assert underscored_imports(pkg) == ["pkg/sub/b.py:1: pkg.a._hidden", "pkg/sub/b.py:5: pkg.a._hidden"]


def test_no_module_imports_another_modules_underscored_name():
    found = underscored_imports()
    assert not found, "an underscored name is its module's own; make it public or keep it in its module: " + \
        "; ".join(found)


# --- Ray through its public API only ----------------------------------------------------------------------

RAY_PRIVATE = ("_private", "_raylet")   # Ray's internals: they change between releases without notice


def ray_private_uses(root: Path = PACKAGE) -> list[str]:
    """``path:line: name`` for each use of Ray's private modules under ``root``: an import of
    ``ray._private...`` / ``ray._raylet`` (any form) or an attribute ``ray._private`` / ``ray._raylet``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "ray":
                names = [f"ray.{node.attr}"]
            for name in names:
                parts = name.split(".")
                if parts[0] == "ray" and len(parts) > 1 and parts[1] in RAY_PRIVATE:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {'.'.join(parts[:2])}")
                    break
    return sorted(set(found))


def test_the_ray_private_check_finds_every_form(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import ray\nfrom ray.util import placement_group\nray.get_runtime_context()\n"
                              "from ray.experimental.internal_kv import _internal_kv_get\n")
    assert ray_private_uses(pkg) == []
    (pkg / "a.py").write_text("import ray\nimport ray._private.services\nfrom ray._raylet import GcsClient\n"
                              "from ray import _private\nray._private.worker.global_worker\n")
    assert ray_private_uses(pkg) == ["pkg/a.py:2: ray._private", "pkg/a.py:3: ray._raylet",
                                     "pkg/a.py:4: ray._private", "pkg/a.py:5: ray._private"]


def test_ray_is_used_through_its_public_api_only():
    found = ray_private_uses()
    assert not found, "Ray's private modules change without notice; use Ray's public API: " + "; ".join(found)


# --- every module in architecture.md's code map ---------------------------------------------------------

def code_map(text: str) -> dict[str, str]:
    """The code map's entries: the first word of each unindented line of the ```text block under "## The
    code map" (``rayconv/config.py``, ``data/``) -> that line with its indented continuation lines."""
    section = text.split("## The code map", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```text\n(.*?)^```$", section, re.M | re.S)
    entries: dict[str, str] = {}
    key = None
    for line in (block.group(1) if block else "").splitlines():
        if line and not line[0].isspace():
            key = line.split()[0].rstrip(",")
            entries[key] = line
        elif key:
            entries[key] += "\n" + line
    return entries


def named(word: str, text: str) -> bool:
    return re.search(rf"(?<![\w./-]){re.escape(word)}(?![\w-])", text) is not None


def in_code_map(rel: Path, entries: dict[str, str]) -> bool:
    """Whether the module at ``rel`` (relative to the package) is named in the code map: a top module by
    its file or stem on a ``rayconv/`` line, a module of a folder by its stem in that folder's entry (and
    each subfolder between), a ``__main__`` by its ``python -m`` command, an ``__init__`` by its folder."""
    *folders, file = rel.parts
    stem = file[: -len(".py")]
    if not folders:
        top = "\n".join(v for k, v in entries.items() if k.startswith("rayconv/"))
        return named(stem, top) or named(f"rayconv/{file}", top)
    text = entries.get(folders[0] + "/")
    if text is None or not all(named(sub + "/", text) or named(sub, text) for sub in folders[1:]):
        return False
    if stem == "__init__":
        return True
    if stem == "__main__":
        return f"python -m rayconv.{'.'.join(folders)}" in text
    return named(stem, text)


def test_the_code_map_check():
    entries = code_map("## The code map\n\n```text\nrayconv/api.py  the API\n"
                       "rayconv/run.py, plan.py   commands\n"
                       "data/     source (the interface), raw_shards\n          order; pipeline/ (p2p)\n"
                       "bench/    `python -m rayconv.bench`: table\n```\n\n## Next\n```text\nother/ x\n```\n")
    assert set(entries) == {"rayconv/api.py", "rayconv/run.py", "data/", "bench/"}
    for rel in ("api.py", "plan.py", "data/source.py", "data/order.py", "data/__init__.py",
                "data/pipeline/p2p.py", "bench/__main__.py", "bench/table.py"):
        assert in_code_map(Path(rel), entries), rel
    for rel in ("config.py", "data/raw.py", "data/shards.py", "data/sub/order.py", "other/x.py",
                "tune/__main__.py", "data/__main__.py"):
        assert not in_code_map(Path(rel), entries), rel


def test_every_module_is_named_in_the_code_map():
    entries = code_map(ARCHITECTURE.read_text())
    missing = [str(p.relative_to(PACKAGE.parent)) for p in sorted(PACKAGE.rglob("*.py"))
               if not in_code_map(p.relative_to(PACKAGE), entries)]
    assert not missing, "modules docs/architecture.md's code map does not name: " + ", ".join(missing)


# --- RESULTS.md: a report of the current figures ------------------------------------------------------

# A commit in prose: 7 to 40 hex digits with at least one digit and one letter, as a word of its own.
COMMIT = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


def prose(markdown: str) -> str:
    """Markdown less what may name a commit as a path: link targets and any word with a ``/`` in it (a
    results folder ``benchmarks/results/h200x1-2026-12-05-4d23441/`` names the commit it measured)."""
    return re.sub(r"\S*/\S*", " ", re.sub(r"\]\([^)]*\)", "]", markdown))


def test_the_commit_pattern():
    for text in ("measured at 4d23441 on", "(at e997f78)", "commit 9d0ec36d1a2b3c4d5e6f708192a3b4c5d6e7f809",
                 "a86e2f5, then"):
        assert COMMIT.search(prose(text)), text
    for text in ("[rows](results/h200x1-2026-12-05-4d23441/)", "`results/cpu2-2026-12-05-a9a694d/`",
                 "1,280,000 images", "2026-12-05", "the faceted decade", "1234567 steps", "deadbeef",
                 "0x7f3a9c2",
                 "clean_clone_d96a702.txt"):
        assert not COMMIT.search(prose(text)), text


def test_results_is_a_report_of_at_most_400_lines_naming_no_commit():
    text = RESULTS.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"benchmarks/RESULTS.md has {lines} lines (at most {MAX_LINES})"
    commits = sorted({m.group(0) for m in COMMIT.finditer(prose(text))})
    assert not commits, ("benchmarks/RESULTS.md names commits in its prose (link the results folder "
                         "instead): " + ", ".join(commits))


def test_results_links_resolve():
    """Every relative link of RESULTS.md (its results folders and files) exists."""
    text = re.sub(r"^```.*?^```$", "", RESULTS.read_text(), flags=re.M | re.S)
    missing = [t for t in re.findall(r"\]\(([^)\s#]+)[^)]*\)", text)
               if not t.startswith(("http://", "https://")) and not (RESULTS.parent / t).exists()]
    assert not missing, "benchmarks/RESULTS.md links to what does not exist: " + ", ".join(missing)


# --- every test module stands alone ------------------------------------------------------------------------
# A module passes run alone and after any other: no hook orders the modules; no module imports another
# test module; the fixtures of conftest.py that outlive a test are the clusters, each checked (and started
# fresh where needed) on entry; a module marked ``takes_kept_actors`` makes rayconv runs only, which take
# kept actors or start their own, so kept actors speed it up and are never needed; and no test changes what
# a module-scoped fixture built, so a failing test leaves nothing behind for the next.

TESTS = REPO / "tests"
CHECKED_ON_ENTRY = {"ray_cluster", "two_nodes"}   # conftest.py's fixtures wider than a test
# calls that change their receiver (a folder's files, a list, a dict, a set)
CHANGES = {"write_text", "write_bytes", "unlink", "mkdir", "touch", "rename", "rmdir", "chmod", "symlink_to",
           "hardlink_to", "append", "extend", "insert", "update", "clear", "pop", "popitem", "setdefault",
           "add", "discard", "remove", "sort", "reverse"}
# shutil's and os's calls that change their arguments: which ones
CHANGES_ARG = {"rmtree": (0,), "move": (0, 1), "copy": (1,), "copy2": (1,), "copyfile": (1,),
               "copytree": (1,), "unlink": (0,), "rename": (0, 1)}


def modules_of_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name.startswith("test_"))


def fixture_scope(fn: ast.AST):
    """The scope of a ``@pytest.fixture`` function ("function" when not given), None for other functions."""
    for d in getattr(fn, "decorator_list", []):
        call = d if isinstance(d, ast.Call) else None
        target = call.func if call else d
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            kw = {k.arg: k.value for k in (call.keywords if call else [])}
            scope = kw.get("scope")
            return scope.value if isinstance(scope, ast.Constant) else "function"
    return None


def root_name(expr: ast.AST):
    """The name an expression reaches into: ``a`` of ``a``, ``a.b``, ``a[0]``, ``a / "x"``; else None."""
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.BinOp, ast.Starred)):
        expr = expr.left if isinstance(expr, ast.BinOp) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def fixture_changes(source: str, where: str = "") -> list[str]:
    """``where:line: name`` for every change a test (or a function-scoped fixture) makes to what a
    module-scoped fixture of the same module built: a changing call on it or on a path under it
    (``(built / "x").write_text``, ``built.append``, ``shutil.rmtree(built)``), an item or attribute
    assigned or deleted; names bound to a part of it (``out, rec = built``) count as it."""
    tree = ast.parse(source)
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    # fixtures that outlive one test (scopes wider than function and class): built once, shared
    shared = {f.name for f in functions if fixture_scope(f) not in (None, "function", "class")}
    found = []
    for f in functions:
        if f.name in shared:
            continue
        roots = {a.arg for a in f.args.args} & shared
        changed = True
        while changed:   # names bound from a root are roots
            changed = False
            for n in ast.walk(f):
                if isinstance(n, ast.Assign) and root_name(n.value) in roots:
                    for t in n.targets:
                        for name in ([e for e in t.elts] if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(name, ast.Name) and name.id not in roots:
                                roots.add(name.id)
                                changed = True
        for n in ast.walk(f):
            hit = None
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr in CHANGES and root_name(n.func.value) in roots:
                    hit = root_name(n.func.value)
                elif n.func.attr in CHANGES_ARG and isinstance(n.func.value, ast.Name) \
                        and n.func.value.id in ("shutil", "os"):
                    args = [n.args[i] for i in CHANGES_ARG[n.func.attr] if i < len(n.args)]
                    hit = next((root_name(a) for a in args if root_name(a) in roots), None)
            elif isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                hit = next((root_name(t) for t in targets
                            if isinstance(t, (ast.Subscript, ast.Attribute)) and root_name(t) in roots), None)
            if hit:
                found.append((n.lineno, f"{where}:{n.lineno}: {hit}"))
    return [text for _, text in sorted(found)]


def test_the_fixture_change_check():
    source = """import pytest, shutil
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return tmp_path_factory.mktemp("b")
@pytest.fixture(scope="module")
def pair(built):
    (built / "x").write_text("")
    return built, []
def test_reads(built, pair, tmp_path):
    shutil.copytree(built, tmp_path / "c")
    (tmp_path / "c" / "y").write_text("")
    a, b = pair
    assert len(b) == 0 and (a / "x").read_text() == ""
"""
    assert fixture_changes(source) == []
    source += """def test_writes(built, pair, tmp_path):
    (built / "y").write_text("")
    a, b = pair
    b.append(1)
    shutil.rmtree(a / "x")
    shutil.copy(tmp_path, built / "z")
    pair[1][:] = []
"""
    assert fixture_changes(source) == [":15: built", ":17: b", ":18: a", ":19: built", ":20: pair"]


def test_no_test_changes_what_a_module_scoped_fixture_built():
    found = [c for p in modules_of_tests() for c in fixture_changes(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, ("a test changes what a module-scoped fixture built (the next test would see the "
                       "change, or a half-made one where it failed): work on a copy in tmp_path: "
                       + "; ".join(found))


def test_no_hook_orders_the_modules_and_no_module_imports_another():
    found = []
    for p in sorted(TESTS.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.FunctionDef) and n.name == "pytest_collection_modifyitems":
                found.append(f"{p.relative_to(REPO)}:{n.lineno}: reorders the collected tests")
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) else []
            found += [f"{p.relative_to(REPO)}:{n.lineno}: imports {m}" for m in names
                      if m.rpartition(".")[2].startswith("test_")]
    assert not found, "each test module runs alone and in any order: " + "; ".join(found)


def test_conftests_wider_fixtures_are_the_clusters_checked_on_entry():
    wider = {f.name for f in ast.parse((TESTS / "conftest.py").read_text()).body
             if fixture_scope(f) not in (None, "function")}
    assert wider <= CHECKED_ON_ENTRY, (
        f"conftest.py's {sorted(wider - CHECKED_ON_ENTRY)} outlive a test: a module must get it as if no "
        "module ran before (check it on entry), then name it in CHECKED_ON_ENTRY")


STARTS_ON_RAY = {"remote", "placement_group", "own_head", "local_ray", "init", "Popen", "run", "check_output"}


def starts_on_the_cluster(source: str, where: str = "") -> list[str]:
    """``where:line: call`` for each actor, task, placement group, cluster or command a module marked
    ``takes_kept_actors`` starts itself (none for a module without the mark)."""
    tree = ast.parse(source)
    if not any(isinstance(n, ast.Attribute) and n.attr == "takes_kept_actors" for n in ast.walk(tree)):
        return []
    found = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        func = n.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
        if name in STARTS_ON_RAY and (name not in ("run", "init") or owner in ("subprocess", "ray")):
            found.append((n.lineno, f"{where}:{n.lineno}: {name}"))
    return [text for _, text in sorted(found)]


def test_the_kept_actors_check():
    plain = "import ray, subprocess\ndef test_a():\n    ray.init()\n    subprocess.run(['x'])\n" \
        "    f.remote()\n"
    assert starts_on_the_cluster(plain) == []
    marked = "import pytest\npytestmark = pytest.mark.takes_kept_actors\n" + plain + "    train_run(cfg)\n"
    assert starts_on_the_cluster(marked) == [":5: init", ":6: run", ":7: remote"]


def test_modules_taking_kept_actors_start_nothing_on_the_cluster_themselves():
    """A module marked ``takes_kept_actors`` leaves the actors earlier runs kept on the cluster: its own
    actors, tasks, placement groups or commands could find the cluster's CPUs held by them."""
    found = [c for p in modules_of_tests()
             for c in starts_on_the_cluster(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, "takes_kept_actors: its tests make rayconv runs only (or drop the mark): " + \
        "; ".join(found)


# Names retired so that each concept has one word (docs/architecture.md's glossary): "shard" is a data
# file of a prepared folder, a filter split makes slices, a checkpoint holds rank files, a replica
# reads its share of the batch, "part" is the layers one actor holds, V is ``virtual_stages``.
RETIRED = {
    "_shard_module": "_slice_module", "_on_shard": "_on_slice", "sharded": "sliced",
    "sharded_costs": "sliced_costs", "val_shard": "replica_val_indices",
    "test_shard": "replica_test_indices", "num_chunks": "virtual_stages", "sgd": "forward_backward_update",
    "part_of": "rank_file_of", "write_part": "write_rank_file", "checkpoint_part": "checkpoint_rank_file",
    "PartSink": "RankFileSink", "PART_FORMAT": "RANK_FILE_FORMAT", "CHUNK_BYTES": "PIECE_BYTES",
    "n_chunks": "n_microbatches",
}
ONE_DEFINITION = ("learning_rate",)   # defined once in rayconv/ (the schedule's closed form: schedule_lr)


def retired_names(source: str, where: str = "") -> list[str]:
    """``where:line: name -> its word`` for every identifier of ``source`` that ``RETIRED`` names
    (strings and comments are not identifiers: a flag or a quoted choice such as "sgd" stays)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [f"{where}:{t.start[0]}: {t.string} -> {RETIRED[t.string]}" for t in tokens
            if t.type == tokenize.NAME and t.string in RETIRED]


def definitions(name: str, root: Path = PACKAGE) -> list[str]:
    """Where a function or class called ``name`` is defined under ``root``."""
    return [f"{p.relative_to(root.parent)}:{n.lineno}" for p in sorted(root.rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name]


def test_the_retired_names_check(tmp_path):
    source = 'OPT = "sgd"  # sharded\ndef sgd(num_chunks):\n    return num_chunks.sharded\n'
    assert retired_names(source) == [":2: sgd -> forward_backward_update", ":2: num_chunks -> virtual_stages",
                                     ":3: num_chunks -> virtual_stages", ":3: sharded -> sliced"]
    (tmp_path / "a.py").write_text("def learning_rate():\n    pass\n")
    (tmp_path / "b.py").write_text("class learning_rate:\n    pass\n")
    assert definitions("learning_rate", tmp_path) == [f"{tmp_path.name}/a.py:1", f"{tmp_path.name}/b.py:1"]


def test_no_retired_name_and_one_definition_per_word():
    """rayconv/ uses one word per concept: no identifier ``RETIRED`` names, and a word of
    ``ONE_DEFINITION`` is defined once."""
    found = [r for p in modules().values() for r in retired_names(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, "retired names (use the glossary's word): " + "; ".join(found)
    twice = {name: where for name in ONE_DEFINITION if len(where := definitions(name)) > 1}
    assert not twice, f"defined more than once (name them after what each computes): {twice}"
