"""rayconv.files: atomic writes leave files with the mode a plain open would."""

from __future__ import annotations

import stat

from rayconv import files as metrics


def test_atomic_write_gives_files_the_mode_a_plain_open_would(tmp_path):
    metrics.atomic_write(tmp_path / "a.txt", lambda tmp: open(tmp, "w").write("x"))
    mode = stat.S_IMODE((tmp_path / "a.txt").stat().st_mode)
    assert mode == 0o666 & ~metrics._UMASK, oct(mode)  # not mkstemp's 0600
    if not metrics._UMASK & 0o044:
        assert mode & 0o044, oct(mode)  # readable by others, as results shared on a cluster need
