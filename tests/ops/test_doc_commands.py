"""Every shell command in README.md and docs/*.md (their ```sh blocks) is checked, and every link between
them resolves.

How each command is checked (``KINDS``; a command of no kind fails ``test_every_command_has_a_kind``):

* run here: the shared-host ``ray start`` (its own temp dir, the ports as written; stopped by its PID
  once its GCS and Ray client server listen), ``python -m rayconv.run --help``, ``python -c ...``;
* parsed by the command's own argument parser (training and measuring runs, too long to run here):
  ``rayconv.run`` and ``rayconv`` (``rayconv.flags.parse_args``: every flag and ``Config.validate``),
  ``rayconv.plan``, ``rayconv.prepare``, ``rayconv.bench``, ``rayconv.tune`` (its parser and its checks before
  Ray starts);
* run by another test, named here and checked to exist: the main job (``tests/ops/test_cli.py``), the
  test command (``.ci/run``), ``ray job submit`` (``tests/ops/test_dashboard.py``, whose inner
  ``rayconv.run`` is parsed here too), a Ray head started by ``setsid`` as a process group of its own and
  ended by SIGTERM to that group (``tests/actors/test_kept_across_commands.py``'s ``head``);
* install commands: the same as ``.ci/run``'s, which CI runs on a fresh machine;
* scripts under ``benchmarks/`` and ``tests/``: the file exists and takes every flag given;
* commands that need a cloud or a running run (``ray up``/``down``/``dashboard``/``rsync-down`` of
  ``cluster.yaml``, checked by ``tests/unit/test_cluster_yaml.py``; ``ray list actors`` and ``curl`` of
  the state API, which ``tests/ops/test_dashboard.py`` reads): their files and the test exist."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line, text) of every fenced code block of a Markdown file."""
    text = path.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


def commands() -> list[tuple[str, list[str]]]:
    """("file:line", argv) of every command of every ```sh block (``\\`` continuations joined, comments
    dropped, ``a && b`` as two commands)."""
    out = []
    for path in DOCS:
        for lang, line, text in blocks(path):
            if lang != "sh":
                continue
            for i, cmd in enumerate(text.replace("\\\n", " ").splitlines()):
                argv = shlex.split(cmd, comments=True)
                while argv:
                    cut = argv.index("&&") if "&&" in argv else len(argv)
                    out.append((f"{path.relative_to(REPO)}:{line + 1 + i}", argv[:cut]))
                    argv = argv[cut + 1:]
    return out


def ci_commands() -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in (REPO / ".ci" / "run").read_text().splitlines()]


def has_function(path: str, name: str) -> None:
    assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path} has no {name}"


def parse_run(argv: list[str]) -> None:
    from rayconv.flags import parse_args
    parse_args(argv)


def parse_plan(argv: list[str]) -> None:
    from rayconv.plan import parse_args
    parse_args(argv)


def parse_prepare(argv: list[str]) -> None:
    from rayconv.prepare import _parser
    a = _parser().parse_args(argv)
    assert (a.dir is None) != (a.convert is None) and (a.dir is None or a.out), \
        "give DIR --out SHARDS or --convert"


def parse_bench(argv: list[str]) -> None:
    from rayconv.bench.__main__ import check, parse_args
    check(parse_args(argv))


def parse_tune(argv: list[str]) -> None:
    """rayconv.tune's own parser, then its checks before Ray starts: the space against the run's
    flags, every listable sample with the base settings (a resume reads its folder: parsed only)."""
    from rayconv.flags import read_settings
    from rayconv.tune.__main__ import parser
    from rayconv.tune.space import check_space, read_space
    args, rest = parser().parse_known_args(argv)
    if not args.resume:
        check_space(read_space(args.space), read_settings(rest))


def check_install(argv: list[str]) -> None:
    ci = ci_commands()
    if argv[:3] == ["python3", "-m", "venv"]:
        assert any(c[:3] == argv[:3] for c in ci)
    elif argv[0] == ".":
        assert any(c[:1] in (["source"], ["."]) and c[1].endswith("/bin/activate") for c in ci)
    elif argv[0] == "pip":
        assert [a for a in argv] in [[a for a in c if a != "-q"] for c in ci], f"{argv} is not .ci/run's"
    else:  # sudo apt-get install PACKAGES
        assert argv[:3] == ["sudo", "apt-get", "install"]
        installed = {a for c in ci if "install" in c for a in c if not a.startswith("-")}
        assert set(argv[3:]) <= installed, f"{argv[3:]} not installed by .ci/run"


def check_script(argv: list[str]) -> None:
    script = REPO / argv[1]
    assert script.is_file(), f"{argv[1]} does not exist"
    text = script.read_text()
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
        assert f'"{flag}"' in text or f"{flag} " in text, f"{argv[1]} takes no {flag}"


def check_pytest(argv: list[str]) -> None:
    args = argv[3:] if argv[:3] == ["python", "-m", "pytest"] else argv[1:]
    valued = {"-m", "-n", "-k", "-p"}   # (options whose value is the next word)
    for before, a in zip([None, *args], args):
        if not a.startswith("-") and before not in valued:
            assert (REPO / a.split("::")[0]).exists(), f"{a} does not exist"
    if "-n" in args:
        assert args[args.index("-n") + 1].isdigit(), "-n takes a number of test processes"
    if "-m" in args:
        marker = args[args.index("-m") + 1]
        assert f'"{marker}:' in (REPO / "pyproject.toml").read_text(), f"no marker {marker}"


def run_help(argv: list[str]) -> None:
    from rayconv.flags import parse_args
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        parse_args(argv[3:])
    assert e.value.code == 0 and "--dp" in out.getvalue() and "--checkpoint-every" in out.getvalue()


def run_python_c(argv: list[str]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(argv[2], "<python -c>", "exec"), {})
    assert out.getvalue().strip(), f"{argv} printed nothing"


def check_job_submit(argv: list[str]) -> None:
    has_function("tests/ops/test_dashboard.py", "test_ray_job_submit")
    if "--runtime-env-json" in argv:
        json.loads(argv[argv.index("--runtime-env-json") + 1])
    inner = argv[argv.index("--") + 1:]
    assert inner[:3] == ["python", "-m", "rayconv.run"], inner
    parse_run(inner[3:])


def check_cloud(argv: list[str]) -> None:
    if argv[1] in ("up", "down", "dashboard", "rsync-down"):
        assert (REPO / argv[2]).is_file()
        has_function("tests/unit/test_cluster_yaml.py", "test_cluster_yaml_passes_ray_validation")
    else:  # ray list actors, curl of the state API: the dashboard test reads the same API
        has_function("tests/ops/test_dashboard.py", "rayconv_actors")


def is_main_job(argv):
    return argv == ["python", "-m", "rayconv.run"]


# (kind, does the command belong to it, check): the first that matches checks the command.
KINDS = [
    ("run by tests/ops/test_cli.py", is_main_job,
     lambda a: has_function("tests/ops/test_cli.py", "test_main_job_as_the_readme_says")),
    ("run by .ci/run", lambda a: a == ["python", "-m", "pytest", "-q", "tests"],
     lambda a: None if a in [c[-len(a):] for c in ci_commands()]
     else pytest.fail(".ci/run does not run " + shlex.join(a))),
    ("run here", lambda a: a[:3] == ["python", "-m", "rayconv.run"] and a[3:] == ["--help"], run_help),
    ("run here", lambda a: a[:2] == ["python", "-c"], run_python_c),
    ("run here (test_the_shared_host_ray_start)", lambda a: a[:2] == ["ray", "start"], lambda a: None),
    ("the environment test_the_shared_host_ray_start gives the commands after the head",
     lambda a: a == ["export", "RAY_TMPDIR=/tmp/ray-$(id -un)"], lambda a: None),
    ("parsed", lambda a: a[:3] == ["python", "-m", "rayconv.run"], lambda a: parse_run(a[3:])),
    ("parsed", lambda a: a[:1] == ["rayconv"], lambda a: parse_run(a[1:])),
    ("parsed", lambda a: a[:3] == ["python", "-m", "rayconv.plan"], lambda a: parse_plan(a[3:])),
    ("parsed", lambda a: a[:3] == ["python", "-m", "rayconv.prepare"], lambda a: parse_prepare(a[3:])),
    ("parsed", lambda a: a[:3] == ["python", "-m", "rayconv.bench"], lambda a: parse_bench(a[3:])),
    ("parsed", lambda a: a[:3] == ["python", "-m", "rayconv.tune"], lambda a: parse_tune(a[3:])),
    ("install", lambda a: a[:3] == ["python3", "-m", "venv"] or a[:1] in (["."], ["pip"])
     or a[:3] == ["sudo", "apt-get", "install"], check_install),
    ("script",
     lambda a: a[:1] in (["python"], ["bash"]) and a[1:2] and a[1].startswith(("benchmarks/", "docs/")),
     check_script),
    ("pytest", lambda a: a[:3] == ["python", "-m", "pytest"] or a[:1] == ["pytest"], check_pytest),
    ("ray job submit", lambda a: a[:3] == ["ray", "job", "submit"], check_job_submit),
    ("TensorBoard's own viewer; the event files are read back by tests/unit/test_tensorboard.py",
     lambda a: a[:2] == ["tensorboard", "--logdir"],
     lambda a: has_function("tests/unit/test_tensorboard.py",
                            "test_rows_become_scalars_once_and_a_resume_purges_from_its_step")),
    ("done by tests/actors/test_kept_across_commands.py's head: ray start --block as a process group of "
     "its own, ended by SIGTERM to that group",
     lambda a: a[:3] == ["setsid", "ray", "start"] or a[:2] == ["kill", "--"],
     lambda a: has_function("tests/actors/test_kept_across_commands.py", "head")),
    ("needs a cloud or a running run",
     lambda a: a[:2] in (["ray", "up"], ["ray", "down"], ["ray", "dashboard"], ["ray", "rsync-down"],
                         ["ray", "list"]) or a[:1] == ["curl"], check_cloud),
]
COMMANDS = commands()


def test_the_docs_have_commands():
    where = {w.split(":")[0] for w, _ in COMMANDS}
    assert "README.md" in where and len(where) >= 6, where
    assert any(a[:2] == ["ray", "start"] for _, a in COMMANDS)


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(a)[:60]}" for w, a in COMMANDS])
def test_every_command_has_a_kind(where, argv):
    kinds = [(name, check) for name, belongs, check in KINDS if belongs(argv)]
    assert kinds, f"{where}: {shlex.join(argv)} is of no kind: give it one in tests/ops/test_doc_commands.py"
    try:
        kinds[0][1](argv)
    except SystemExit as e:  # argparse's refusal (its one line is on stderr)
        pytest.fail(f"{where}: {shlex.join(argv)} exits {e.code}")


def test_python_blocks_compile():
    for path in DOCS:
        for lang, line, text in blocks(path):
            assert lang in ("sh", "python", "text"), f"{path.name}:{line}: a block in {lang or 'no language'}"
            if lang == "python":
                compile(text, f"{path.name}:{line}", "exec")


def test_no_command_outside_a_fenced_block():
    """An indented (4-space) block outside a fence would be a command no test reads."""
    for path in DOCS:
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
        lines = text.splitlines()
        for i, line in enumerate(lines):
            assert not (line.startswith("    ") and (i == 0 or not lines[i - 1].strip())), \
                f"{path.name}:{i + 1}: an indented block; fence it (```sh)"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_link_resolves():
    for path in DOCS:
        text = FENCE.sub("", path.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.name}: link to {target}: no such file"
            assert REPO in dest.parents or dest == REPO, \
                f"{path.name}: {target} points outside the repository"
            if anchor:
                assert anchor in anchors(dest), \
                    f"{path.name}: link to {target}: no such heading in {dest.name}"


def test_every_path_named_exists():
    """The files the docs name (scripts, tests, modules, pictures) exist."""
    for path in DOCS:
        for name in re.findall(
            r"(?<![\w/.])((?:rayconv|tests|benchmarks|examples|docs)/[\w./-]*\.(?:py|sh|md|png|yaml))\b",
            path.read_text(),
        ):
            assert (REPO / name.split("::")[0]).exists(), f"{path.name} names {name}, which does not exist"


def test_nothing_points_outside_the_repository():
    for path in [*DOCS, REPO / "pyproject.toml"]:
        assert "../shared" not in path.read_text(), f"{path.name} points into ../shared"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _environ(**values):
    """Within: the environment with ``values`` set (None: unset); as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_the_shared_host_ray_start():
    """docs/operations.md's ``ray start`` as written (its temp dir one of its own here), with ``--block``
    so that its PID owns the head's processes: Ray accepts every port (a port inside the worker range is
    refused at once) and the GCS and the Ray client server listen on the ports given."""
    [argv] = [a for _, a in COMMANDS if a[:2] == ["ray", "start"]]
    ports = {a: int(v) for a, v in zip(argv, argv[1:]) if a.endswith("-port")}
    assert {"--port", "--ray-client-server-port", "--dashboard-port"} <= set(ports)
    taken = [p for p in ports.values() if _listening(p)]
    if taken:
        pytest.skip(f"ports {taken} are taken on this host (another Ray instance?)")
    temp_dir = tempfile.mkdtemp(prefix="rc-doc-", dir="/tmp")  # short: Ray's socket paths have a length limit
    i = argv.index("--temp-dir")
    cmd = [str(Path(sys.executable).with_name("ray")), *argv[1:i + 1], temp_dir, *argv[i + 2:], "--block"]
    log = Path(temp_dir) / "ray-start.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("w") as f:
        head = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 120
        address_file = Path(temp_dir) / "ray_current_cluster"   # (written once the head is up)
        while not (_listening(ports["--port"]) and _listening(ports["--ray-client-server-port"])
                   and address_file.exists()):
            assert head.poll() is None, f"ray start exited {head.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, \
                f"ray start did not listen within 120 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        # the commands after it, with the RAY_TMPDIR the docs export, join it (no --address)
        from rayconv.cluster.connect import find_cluster
        with _environ(RAY_TMPDIR=temp_dir, RAY_ADDRESS=None):
            found, how = find_cluster(None)
        assert found.endswith(f":{ports['--port']}"), found
        assert how == f"Ray's address file {address_file}", how
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # the head's own process group: every process it started
        head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
