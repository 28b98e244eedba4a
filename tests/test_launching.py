"""The one launcher of the runner (bench/run.py) and the GPU check (scripts/gpu_plan.py), support/launching.py:
a launch's status, wall and CPU seconds and log; at its timeout, its whole session stopped, each process
given its grace and those that ignore SIGTERM killed."""
import os
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from support import launching


def ends_with(log):
    return log.read_text(encoding="utf-8").splitlines()[-1]


@pytest.mark.quick
def test_a_launch_reports_its_status_and_the_cpu_seconds_of_the_processes_it_waited_for(tmp_path):
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    command = [sys.executable, "-c", f"import os, subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}]); "
               f"exec({burn!r}); print(os.environ['ADDED']); sys.exit(3)"]
    log = tmp_path / "launch.log"
    launched = launching.launch(command, log, 60, ROOT, {"ADDED": "to ours"}, shown="the command")
    assert launched.status == 3
    assert 0.5 <= launched.cpu_seconds <= launched.wall * os.cpu_count()  # its own 0.3 s and its child's
    lines = log.read_text(encoding="utf-8").splitlines()
    assert lines[:2] == ["$ the command", "to ours"]
    assert lines[2].startswith(f"$ # exit status 3, {launched.wall:.1f} s wall, {launched.cpu_seconds:.1f} CPU s")


@pytest.mark.quick
def test_a_timeout_stops_the_whole_session_giving_each_process_its_grace(tmp_path):
    """The launcher ends at once on SIGTERM; one process it started takes 0.2 s to clean up (it gets them:
    SIGKILL comes after the grace, not when the launcher ends); another ignores SIGTERM (SIGKILL ends it)."""
    cleaned, deaf = tmp_path / "cleaned", tmp_path / "deaf.pid"
    script = (f"(trap '' TERM; exec sleep 60) & echo $! > {deaf}; "
              f"(trap 'sleep 0.2; echo yes > {cleaned}; exit' TERM; sleep 60 & wait) & wait")
    log = tmp_path / "launch.log"
    launched = launching.launch(["bash", "-c", script], log, 1, ROOT, grace=2)
    assert launched.status is None and 3 <= launched.wall < 10  # the deaf one held the session for the grace
    assert cleaned.read_text() == "yes\n"
    stat = Path(f"/proc/{deaf.read_text().strip()}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "SIGTERM's deaf process runs on"
    assert ends_with(log).startswith("$ # stopped after 1 s (its timeout), ")
