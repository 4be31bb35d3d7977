"""`jaxpod tensorboard`: TensorBoard on a runs directory, checked before it starts.

A port outside 1..65535 or one already in use, and a LOGDIR that is no directory, are one line
each (TensorBoard itself would print a traceback, or exit 255). Then TensorBoard replaces this
process, so signals reach it.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from jaxpod.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_port(host: str, port: int) -> None:
    """One-line `UserError` unless a server can listen on `host`:`port` now."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is no TCP port; pick one in 1..65535 (default 6006)")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UserError(
            f"--port {port} on {host} cannot be used ({why}); pick another port"
        ) from None


def serve(logdir: str, host: str, port: int) -> None:
    """Check, then replace this process with TensorBoard serving `logdir` on `host`:`port`."""
    if host not in LOOPBACK:
        print(
            f"jaxpod: warning: serving TensorBoard on {host}: it has no authentication, "
            "anyone who can reach this port can read your runs",
            file=sys.stderr,
        )
    check_port(host, port)
    root = Path(logdir).expanduser()
    if not root.is_dir():
        raise UserError(
            f"LOGDIR {logdir} is not a directory (no runs there yet?); pass the directory "
            "your runs are in, e.g. jaxpod tensorboard runs"
        )
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(root)]
    cmd += ["--host", host, "--port", str(port)]
    print(f"TensorBoard on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # TensorBoard replaces this process: signals reach it
