"""The run directory's claim (`jaxpod.run.logdir`), the host-RAM check (`jaxpod.run.hostmem`)
and `~` in path keys: jax-free, in process (two real runs: tests/cli/test_interrupt_cli.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest
from helpers import make_tiny_cfg

from jaxpod.errors import UserError
from jaxpod.planner.plan import plan
from jaxpod.run import hostmem
from jaxpod.run.logdir import LOCK_FILE, check_logdir, hold


def test_lock_is_taken_released_and_leaves_nothing(tmp_path):
    run = tmp_path / "a" / "b"
    lock = hold(run)
    assert hold(run) is lock  # the same process may claim it again (profile, then preflight)
    holder = (run / LOCK_FILE).read_text()
    assert f'"pid": {os.getpid()}' in holder
    lock.release()
    assert not (tmp_path / "a").exists()  # created by the claim, left empty: removed


def test_release_keeps_a_directory_with_a_record(tmp_path):
    with hold(tmp_path / "run") as lock:
        (lock.logdir / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]


def test_a_lock_held_by_another_process_is_refused_naming_it(tmp_path):
    tmp_path.joinpath(LOCK_FILE).write_text("")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, json, os, sys, time\n"
            f"fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, json.dumps({'pid': os.getpid(), 'host': 'hostA'}).encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"in use by another jaxpod run .pid {holder.pid} "):
            hold(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    hold(tmp_path).release()  # the kernel dropped the dead holder's lock


def test_a_stale_lock_file_is_taken_over_with_a_note(tmp_path, capsys):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (tmp_path / LOCK_FILE).write_text(f'{{"pid": {dead}, "host": "h"}}\n')
    with hold(tmp_path):
        fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxpod: note: ") and f"pid {dead} on host h" in err, err
    assert "taking it over" in err and "\n" not in err


@pytest.mark.parametrize("inside", ["", "sub"], ids=["is-a-file", "under-a-file"])
def test_a_file_in_the_way_is_one_line(tmp_path, inside):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"is a file, not a directory; pick another train.logdir"):
        check_logdir(tmp_path / "f" / inside if inside else tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


def test_a_file_where_checkpoints_go_is_one_line(tmp_path):
    """Refused before the run trains, not when its first checkpoint cannot be saved."""
    (tmp_path / "checkpoints").write_text("x")
    with pytest.raises(UserError, match=r"checkpoints is a file, where checkpoints go; pick"):
        check_logdir(tmp_path)


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/6"])
def test_a_runs_checkpoints_are_not_a_run_directory(tmp_path, inside):
    """A logdir in `<run>/checkpoints` would train afresh inside the saved steps."""
    run = tmp_path / "run"
    (run / "checkpoints" / "6").mkdir(parents=True)
    (run / "config.yaml").write_text("devices: 8\n")
    with pytest.raises(UserError, match=r"inside the checkpoints of the run in .*train.logdir="):
        check_logdir(run / inside)
    check_logdir(run)  # the run itself resumes
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)  # no run around it: a name
    check_logdir(tmp_path / "other" / "checkpoints")


def test_tilde_is_expanded_in_path_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = make_tiny_cfg("train.logdir=~/runs/x", "data.name=text-files", "data.path=~/text")
    assert cfg.train.logdir == f"{tmp_path}/runs/x"
    assert cfg.data.path == f"{tmp_path}/text"


def test_meminfo_and_the_host_ram_refusal(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24684096 kB\nMemAvailable:    2000000 kB\n")
    assert hostmem.available_bytes(meminfo) == 2_000_000 * 1024
    assert hostmem.available_bytes(tmp_path / "none") is None
    cfg = make_tiny_cfg("model.d_model=4096", "model.d_ff=16384")
    need, per_device = hostmem.needed_bytes(cfg)
    assert need == 8 * per_device and per_device > 4e9  # as `jaxpod plan` counts it
    with pytest.raises(UserError) as err:
        hostmem.check_host_ram(cfg, available=2_000_000 * 1024)
    line = str(err.value)
    assert line.startswith("devices=8 virtual CPU devices need ~") and "2.0 GB is available" in line
    assert "use fewer devices" in line and "model.remat=full" in line
    hostmem.check_host_ram(make_tiny_cfg(), available=2_000_000 * 1024)  # tiny fits
    # counted for XLA:CPU whatever device the config names (these devices are CPU devices: an
    # offloaded optimizer state is read in place, not moved in as on a GC200), and a fix the
    # config already has is not offered
    big = ("model.d_model=4096", "model.d_ff=16384", "memory.offload=[optimizer]")
    pod, cpu = (make_tiny_cfg(*big, f"memory.device={d}") for d in ("ipu-gc200", "cpu"))
    assert (
        plan(pod)["bytes_per_device"]["device_total"]
        > plan(cpu)["bytes_per_device"]["device_total"]
    )
    assert hostmem.needed_bytes(pod) == hostmem.needed_bytes(cpu)
    full = make_tiny_cfg("model.d_model=4096", "model.d_ff=16384", "model.remat=full")
    assert "model.remat=full" not in hostmem.host_ram_problem(full, available=2_000_000 * 1024)


def test_xla_out_of_memory_becomes_one_line():
    exc = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4000000000000 bytes.\n at ...")
    assert hostmem.is_oom(exc) and not hostmem.is_oom(ValueError("shape mismatch"))
    line = str(hostmem.oom_error(exc, make_tiny_cfg()))
    assert (
        line.startswith("XLA ran out of memory (RESOURCE_EXHAUSTED: Out of memory")
        and "\n" not in line
    )


MAPPING = '{"mesh": {"replica": 1}, "per_step": 16}'


def test_a_fresh_start_replaces_the_earlier_record(tmp_path):
    """A fresh run in a logdir that holds an earlier run's record (no checkpoint) removes its
    metrics, evals, events and profiler traces; nothing else."""
    from jaxpod.run.resume import start_fresh

    (tmp_path / "mapping.json").write_text(MAPPING)
    old = ["metrics.jsonl", "eval.json", "events.out.tfevents.1.host"]
    old.append("plugins/profile/2026_11_27_13_00_00/host.xplane.pb")
    kept = ["config.until-20.yaml", "notes.txt", "mapping.json"]
    for name in old[:-1] + kept[:-1]:
        (tmp_path / name).write_text("x")
    (tmp_path / old[-1]).parent.mkdir(parents=True)
    (tmp_path / old[-1]).write_text("x")
    assert start_fresh(tmp_path, print) is False
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(kept)


def test_a_fresh_start_in_a_shared_directory_removes_only_jaxpods_files(tmp_path):
    """With files that are not jaxpod's (`--logdir-exists ok`): its own event files only."""
    from jaxpod.run.metrics import MetricsWriter
    from jaxpod.run.resume import start_fresh

    theirs = ["events.out.tfevents.1.theirs", "plugins/profile/x/trace.pb", "notes.txt"]
    for name in theirs:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert start_fresh(tmp_path, print) is True  # not a run yet: nothing removed
    with MetricsWriter(tmp_path) as writer:
        writer.write({"step": 1, "loss": 2.0})
    (tmp_path / "mapping.json").write_text(MAPPING[:-1] + ', "shared_directory": true}')
    assert start_fresh(tmp_path, print) is True
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted([*theirs, "mapping.json"])


def test_a_directory_with_other_files_is_refused_unless_asked(tmp_path):
    (tmp_path / "eval.json").write_text("theirs")
    (tmp_path / "notes.txt").write_text("theirs")
    with pytest.raises(
        UserError,
        match=r"holds files that are not a jaxpod run \(eval.json, "
        r"notes.txt\); .* --logdir-exists ok",
    ):
        check_logdir(tmp_path)
    with pytest.raises(UserError, match=r"already holds eval.json, which jaxpod did not write"):
        check_logdir(tmp_path, foreign_ok=True)
    (tmp_path / "eval.json").unlink()
    check_logdir(tmp_path, foreign_ok=True)
    (tmp_path / "mapping.json").write_text(MAPPING)  # an earlier jaxpod run's
    check_logdir(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "theirs"


@pytest.mark.parametrize("name", [LOCK_FILE, "config.yaml", "mapping.json", "metrics.jsonl"])
def test_a_link_where_the_record_keeps_a_file_is_refused(tmp_path, name):
    victim = tmp_path / "victim.json"
    victim.write_text(MAPPING)
    run = tmp_path / "run"
    run.mkdir()
    if name != "mapping.json":
        (run / "mapping.json").write_text(MAPPING)  # an earlier run's directory
    (run / name).symlink_to(victim)
    with pytest.raises(UserError, match=f"{name} is a symbolic link, where jaxpod keeps"):
        hold(run)
    assert victim.read_text() == MAPPING
