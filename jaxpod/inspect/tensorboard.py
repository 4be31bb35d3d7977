"""`jaxpod tensorboard`: TensorBoard on a runs directory, checked before it starts.

A port outside 1..65535 or one already in use, and a LOGDIR that is no directory, are one line
each (TensorBoard itself would print a traceback, or exit 255). Then TensorBoard replaces this
process, so signals reach it.

A LOGDIR that is a URL (`gs://bucket/runs`, any fsspec filesystem) is served from a local
mirror of its event and profile files in a temporary folder (`jaxpod.inspect.mirror` says why
TensorBoard is not handed the URL), said in one line: TensorBoard runs as a child process while
this one refreshes the mirror every `REFRESH_S` seconds, and the folder is removed when either
ends (Ctrl-C, SIGTERM, SIGHUP stop both).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from jaxpod.data.store import is_url
from jaxpod.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
REFRESH_S = 30  # seconds between two listings of a URL LOGDIR (one listing, changed files)


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
    if is_url(logdir):
        serve_url(logdir, host, port)
        return
    root = Path(logdir).expanduser()
    if not root.is_dir():
        raise UserError(
            f"LOGDIR {logdir} is not a directory (no runs there yet?); pass the directory "
            "your runs are in, e.g. jaxpod tensorboard runs"
        )
    cmd = _command(root, host, port)
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # TensorBoard replaces this process: signals reach it


def _command(root: Path, host: str, port: int) -> list[str]:
    """TensorBoard's command line, its address printed first."""
    print(f"TensorBoard on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(root)]
    return [*cmd, "--host", host, "--port", str(port)]


def serve_url(url: str, host: str, port: int) -> None:
    """TensorBoard on a mirror of the URL `url`, refreshed until TensorBoard ends or a
    signal stops both (see the module)."""
    from jaxpod.inspect.mirror import open_mirror
    from jaxpod.run.interrupt import interrupt_at_once

    interrupt_at_once()  # SIGTERM and SIGHUP too: the child and the mirror go with us
    mirror = open_mirror(url)
    try:
        print(
            f"jaxpod: LOGDIR {url} is a URL: TensorBoard serves a local mirror of its event and "
            f"profile files, {mirror.local}, refreshed every {REFRESH_S} s",
            file=sys.stderr,
            flush=True,
        )
        child = subprocess.Popen(_command(mirror.local, host, port))
        try:
            _refresh_until_done(mirror, child)
        finally:
            child.terminate()
            child.wait()
    finally:
        mirror.remove()
    if child.returncode:
        raise UserError(f"TensorBoard ended with exit code {child.returncode}; its lines say why")


def _refresh_until_done(mirror, child: subprocess.Popen) -> None:
    """Refresh `mirror` every `REFRESH_S` seconds while `child` runs; a refresh that fails
    is one warning, and the mirror stays as it was."""
    while True:
        try:
            child.wait(timeout=REFRESH_S)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            mirror.refresh()
        except Exception as err:  # a store's passing error (network) must not stop the server
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(
                f"jaxpod: warning: refreshing the mirror: {why}; it stays as it was",
                file=sys.stderr,
            )
