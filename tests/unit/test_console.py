"""The command's console, without Ray: a second SIGINT while an interrupted run stops and the process
exits (GNU ``timeout`` signals the process and then its group) stays quiet, one line and exit 130; lines
printed while the progress bar shows are not written onto the bar's line; the start-up clock of a
``rayconv.run.main`` call that is the process's command (the ``rayconv`` console command, the examples)
counts from the process's start."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from rayconv import startup

REPO = Path(__file__).resolve().parents[2]

# The run stands in for a real one (no Ray): the first SIGINT interrupts it, a second arrives while it
# stops its actors, a third while the process exits (where Ray's own atexit shutdown runs).
INTERRUPTED = """
import atexit, os, signal, sys, time
import rayconv.api
from rayconv.signals import sigterm_as_interrupt

def run(cfg):
    with sigterm_as_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        finally:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)

def exiting():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)

rayconv.api.start_and_train = run
atexit.register(exiting)
from rayconv.run import main
sys.argv = ["rayconv", "--steps", "1", "--out", sys.argv[1]]
sys.exit(main())
"""


def test_signals_after_the_first_are_quiet(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED, str(tmp_path / "out")], cwd=tmp_path,
                          timeout=120, capture_output=True, text=True, env=env)
    assert proc.returncode == 130, proc.stderr
    line = "rayconv: interrupted: the run and any actors it started are stopped"
    assert proc.stderr.strip().splitlines() == [line], proc.stderr


BAR = """
from rayconv.config import Config
from rayconv.driver.progress import Progress
progress = Progress(Config(progress=True), 10, 0)
progress.step(0, 0, 1.0, 0.1, 100.0, {})
progress.console(print)("rayconv: step 0 done 1.0 s after the command")
progress.close()
"""


def test_a_line_printed_while_the_bar_shows_starts_its_own_line():
    main, sub = pty.openpty()   # (a terminal of 100 columns: the bar shows)
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", BAR], stdout=sub, stderr=sub, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    os.close(sub)
    raw = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:   # (the other end closed)
            break
        if not chunk:
            break
        raw += chunk
    proc.wait(timeout=60)
    os.close(main)
    text = raw.decode()
    assert "train:" in text and "rayconv: step 0 done" in text, text   # (the bar showed)
    before = text.split("rayconv: step 0 done")[0]
    assert before.replace("\r\n", "\n").split("\n")[-1].split("\r")[-1].strip() == "", repr(text)


def test_the_clock_of_a_main_call_that_is_the_command_starts_with_the_process():
    # the `rayconv` console command and the examples call main right after importing rayconv.run
    clock = startup.begin_command(time.monotonic())
    assert clock.since in ("process start", "rayconv import", "rayconv.run import"), clock.since
    assert startup.after(clock.since) != "after rayconv.run.main was called"
    # a call from Python well after the import (an interactive interpreter) counts from the call
    assert startup.begin_command(time.monotonic() - 60).since == "main call"
