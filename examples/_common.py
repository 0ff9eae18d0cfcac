"""Shared by the examples: run ``python -m rayconv.run`` with a layout; ``--smoke`` makes it 3 steps."""

from __future__ import annotations

import sys

from rayconv.run import main


def run_layout(layout: list[str]) -> int:
    """Run the main job with ``layout`` flags plus the example's own command-line arguments."""
    args = sys.argv[1:]
    if "--smoke" in args:
        args = [a for a in args if a != "--smoke"] + ["--steps", "3", "--no-progress"]
    return main(layout + args)
