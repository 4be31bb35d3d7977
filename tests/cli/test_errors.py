"""`jaxpod.errors`: what the CLI does with stderr around an abandoned read, and how it leaves
when library threads would hold the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_muted_block_hides_fd2_and_restores_it_outside_the_cli(capfd):
    from jaxpod.errors import Muted

    with Muted() as mute:
        os.write(2, b"abandoned read traceback\n")
        assert not mute.keep()  # only the CLI, which exits next, may stay muted
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


# A thread like orbax's signalling threads: its `join` raises on a timeout, and it waits
# far longer than any test (orbax waits 300 s for a signal a failed save never sends).
STUCK_THREAD = """
import threading, time
from jaxpod.errors import exit_now

class Stuck(threading.Thread):
    def join(self, timeout=None):
        super().join(timeout)
        if self.is_alive():
            raise TimeoutError("did not complete")

Stuck(target=time.sleep, args=(600,)).start()
exit_now(2, wait=0.5)
"""


@pytest.mark.cli
def test_exit_now_leaves_threads_whose_join_raises():
    proc = subprocess.run(
        [sys.executable, "-c", STUCK_THREAD], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
