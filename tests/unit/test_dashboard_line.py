"""The header's line on the cluster's Ray dashboard (``driver.progress.dashboard_line``): its address; that
none runs where Ray could not start it; no line where none runs by choice."""

from __future__ import annotations

from rayconv.driver.progress import dashboard_line


def test_the_header_says_the_dashboard_ray_could_not_start_is_not_running():
    url = "http://127.0.0.1:8265"
    assert dashboard_line(url, failed=False) == f"rayconv: Ray dashboard: {url}"
    assert dashboard_line(None, failed=True) == ("rayconv: Ray dashboard: not running (Ray could not start "
                                                 "it; the run goes on)")
    assert dashboard_line(None, failed=False) is None   # (off by choice: no line)
