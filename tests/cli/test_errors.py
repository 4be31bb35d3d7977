"""`jaxpod.errors` in process: what the CLI does with stderr around an abandoned read."""

from __future__ import annotations

import os


def test_muted_block_hides_fd2_and_restores_it_outside_the_cli(capfd):
    from jaxpod.errors import Muted

    with Muted() as mute:
        os.write(2, b"abandoned read traceback\n")
        assert not mute.keep()  # only the CLI, which exits next, may stay muted
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"
