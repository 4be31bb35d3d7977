"""Mistakes a new user makes, each one line naming the field and the fix, exit 2, no traceback,
no file's contents printed, nothing left behind: platforms jax cannot start, paths no filesystem
takes (too long, a NUL byte, a loop of links), a port that is no port or is taken, a chart that
cannot be written, a file that is no config."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
from helpers.cli import SMALL, TINY, assert_user_error, cli_env, jaxpod, without_jax

from jaxpod.platform import tpu_chips_attached

pytestmark = pytest.mark.cli


def cuda_visible() -> bool:
    """Whether jax would start a cuda backend: an NVIDIA device and jax's cuda plugin."""
    devices = Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin")
    return devices and any(importlib.util.find_spec(name) for name in plugins)


@pytest.mark.parametrize(
    ("platform", "why"),
    [
        ("bogus", "Unable to initialize backend 'bogus'"),
        pytest.param(
            "tpu",
            "Unable to initialize backend 'tpu'",
            marks=pytest.mark.skipif(tpu_chips_attached() > 0, reason="a TPU is attached"),
        ),
        pytest.param(  # jax skips cuda without a device, then fails a bare assertion
            "cuda",
            "",
            marks=pytest.mark.skipif(cuda_visible(), reason="jax can start cuda here"),
        ),
    ],
)
def test_a_platform_jax_cannot_start_is_one_line_and_leaves_no_lock(tmp_path, platform, why):
    run = tmp_path / "run"
    env = cli_env(JAX_PLATFORMS=platform)
    proc = jaxpod("train", TINY, *SMALL, f"train.logdir={run}", env=env)
    assert_user_error(proc, f"JAX_PLATFORMS={platform}: {why}", "unset JAX_PLATFORMS")
    assert not run.exists()  # the directory it claimed, released and removed


@pytest.mark.parametrize(
    "logdir, needle",
    [
        ("a" * 300, "is too long (a name in a path holds at most 255 bytes"),
        ("a\\0b", "holds a NUL byte, which no path can"),
        ("loop/x", "cannot be used (a loop of symbolic links)"),
    ],
    ids=["long-name", "nul-byte", "link-loop"],
)
def test_a_logdir_no_filesystem_takes_is_one_line(tmp_path, logdir, needle):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    value = f'"{tmp_path}/{logdir}"' if "\\0" in logdir else f"{tmp_path}/{logdir}"
    proc = jaxpod("train", TINY, *SMALL, f"train.logdir={value}", env=without_jax(tmp_path))
    assert_user_error(proc, "train.logdir=", needle)


@pytest.mark.parametrize(
    ("key", "url", "needle"),
    [
        ("data.path", "s3://bucket/runs/x", "data.path=s3://bucket/runs/x: s3:// needs"),
        ("train.logdir", "nosuchfs://b/x", "no fsspec filesystem knows nosuchfs://"),
    ],
)
def test_a_url_is_refused_not_made_a_local_folder(tmp_path, key, url, needle):
    """`s3://bucket/x` would be the local folder `./s3:/bucket/x`: a URL whose filesystem
    package is not installed (s3fs) or whose protocol no filesystem serves is refused in one
    line before the run directory is claimed, and nothing is made where the command runs."""
    more = ["data.name=text-files"] if key == "data.path" else []
    on = [*more, f"{key}={url}"]
    if key == "data.path":
        on.append(f"train.logdir={tmp_path}/run")
    proc = jaxpod("train", TINY, *SMALL, *on, env=without_jax(tmp_path), cwd=tmp_path)
    assert_user_error(proc, needle)
    assert not (tmp_path / url.split("/")[0]).exists() and not (tmp_path / "run").exists()


def test_a_long_data_path_is_one_line(tmp_path):
    proc = jaxpod(
        "train",
        TINY,
        *SMALL,
        "data.name=text-files",
        f"data.path=/{'d' * 400}",
        f"train.logdir={tmp_path}/run",
        env=without_jax(tmp_path),
    )
    assert_user_error(proc, "data.path=", "is too long")


def test_a_port_that_is_none_or_taken_is_one_line(tmp_path):
    proc = jaxpod("tensorboard", str(tmp_path), "--port", "-5")
    assert_user_error(proc, "--port -5 is no TCP port; pick one in 1..65535")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = jaxpod("tensorboard", str(tmp_path), "--port", str(port))
    assert_user_error(proc, f"--port {port} on 127.0.0.1 cannot be used (Address already in use")


def test_a_chart_that_cannot_be_written_is_one_line(tmp_path):
    proc = jaxpod("plan", TINY, "--chart", "/proc/x.png")
    assert_user_error(proc, "--chart /proc/x.png")


@pytest.mark.parametrize(
    "text",
    ["s3cr3t:*:20228:0:99999:7:::\nbin:*:20228:0:99999:7:::\n", "model: [unclosed, s3cr3t\n"],
    ids=["not-a-config", "not-yaml"],
)
def test_a_file_that_is_no_config_is_never_printed(tmp_path, text):
    (tmp_path / "shadow").write_text(text)
    proc = jaxpod("plan", str(tmp_path / "shadow"), env=without_jax(tmp_path))
    assert_user_error(proc)
    assert "s3cr3t" not in proc.stderr, proc.stderr


def test_an_allowed_change_of_no_key_is_one_line(tmp_path):
    run = ["train", TINY, *SMALL, f"train.logdir={tmp_path}/run"]
    proc = jaxpod(*run, "--allow-changes", "optim,train.stesp", env=without_jax(tmp_path))
    assert_user_error(
        proc, "--allow-changes train.stesp is no config key; did you mean 'train.steps'?"
    )
