"""Shared test setup: 8 virtual CPU devices, one jax compilation cache, markers, scheduling.

XLA reads `XLA_FLAGS` once, when jax initialises its backend, so the flag is set here at import
time: pytest imports this file before any test module (and so before jax is imported by them).
Other XLA flags already in the environment are kept; only the device count is replaced.
jax itself is imported lazily, so jax-free test modules (config, data) stay jax-free.

Compilation cache: the session (the pytest process, its xdist workers and every subprocess the
tests start: `jaxpod` CLI runs, notebook kernels) shares one jax persistent compilation cache,
a fresh temporary directory created by `pytest_configure` and removed by
`pytest_unconfigure`. It is passed on through the environment (`JAX_COMPILATION_CACHE_DIR`,
a minimum compile time, no minimum entry size, and a size limit, which turns on jax's file
lock around reads and writes), so every compile of a program that some process of
the session compiled before is a cache hit: the cache key is the whole program with its
compile options and XLA flags, so a hit is the identical executable. The pytest processes do
not write compiles quicker than a second (most of their ~2,000, eager ops among them, each
compiled once): writing one costs more than compiling it again. CLI subprocesses, which repeat
each other's programs, write every compile (`helpers.cli.CLI_CACHE`). Set
`JAX_COMPILATION_CACHE_DIR` yourself to keep a cache across sessions (it is then not removed).

Markers (registered in pyproject.toml): `cli`, `full_size`, `notebook`, `long_run` and
`engine` name the kinds of test that `make test-fast` leaves out; each of them implies `slow`,
which is what `make test-fast` deselects (`-m "not slow"`). Tests under tests/engine/ and
those using the equivalence lab are `engine` tests without saying so.

Scheduling (`make test`: `--dist loadgroup`): every test runs in its module's group (one
worker per module, module fixtures built once) unless it is marked `xdist_group` itself; the
groups are handed out heaviest first (`HEAVY_FIRST`) so that the two workers finish together.
A session whose tests do not carry their groups, or a whole-suite session (`make test`) in which
a `HEAVY_FIRST` name is no group, stops before it starts (the controller's
`pytest_xdist_node_collection_finished`).

Helpers the test modules share live in `tests/helpers/` (importable as `helpers`); the names
below stay importable from `conftest` too.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from helpers import (  # noqa: F401  (re-exported: `from conftest import ...` keeps working)
    ROOT,
    TINY_YAML,
    free_port,
    make_tiny_cfg,
    mesh_for,
    model_params_and_specs,
)

from jaxpod.platform import use_virtual_cpu_devices  # jax-free: safe before jax starts

DEVICE_COUNT = 8

use_virtual_cpu_devices(DEVICE_COUNT)
os.environ["JAX_PLATFORMS"] = "cpu"

# A size limit turns on jax's file lock around every cache read and write (`filelock`): without
# it a process could read an entry another is still writing ("incomplete or truncated
# stream", a warning and a recompile). 32 GiB: nothing is ever evicted.
CACHE_MAX_BYTES = 32 * 2**30
CACHE_MIN_COMPILE_SECS = 1  # quicker compiles are not written (module docstring)
CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(CACHE_MIN_COMPILE_SECS),
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(CACHE_MAX_BYTES),
}

# Markers that keep a test out of `make test-fast`; each implies `slow`.
SLOW_KINDS = ("cli", "full_size", "notebook", "long_run", "engine")
# `engine` (a whole model's train step or loss and gradients compiled on a mesh, 10-60 s each
# on 2 cores) is implied by these folders and by the equivalence lab's fixture.
ENGINE_FOLDERS = ("tests/engine/",)

# Groups (test modules, or `path@name` / `shared:` names of `xdist_group` marks) in the order
# they are handed to the workers, before every other group: the longest first, as
# `benchmarks/suite_time.py` measured them (its "groups" table) on 2 cores.
HEAVY_FIRST = (
    "shared:lab",  # helpers.lab.LAB_GROUP
    "shared:tiny-efficientnet",  # helpers.TINY_EFFICIENTNET
    "tests/presets/test_preset_runs.py@full-size-compiles",
    "shared:planner-small-gpt",  # helpers.PLANNER_GPT
    "tests/planner/test_efficientnet_bytes.py",
    "tests/presets/test_preset_runs.py@emulated-training",
    "tests/engine/test_schedules_engine.py",
    "tests/notebooks/test_notebooks.py",
    "shared:two-processes",  # helpers.cli.TWO_PROCESSES: the multi-process CLI modules
    "shared:pinned-transformers",  # helpers.PINNED_TRANSFORMERS
    "tests/cli/test_checkpoint_cli.py",
    "tests/optim/test_per_layer.py",
    "tests/engine/test_batch_parts.py",
    "tests/cli/test_resume_cli.py",
    "tests/models/test_efficientnet.py",
    "tests/optim/test_per_layer.py@temporaries",
    "tests/engine/test_bert_engine.py",
    "tests/cli/test_interrupt_cli.py",
)


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """The session's compilation cache (the controller makes it; workers inherit the env)."""
    if _is_xdist_worker(config) or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="jaxpod-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    for key, value in CACHE_ENV.items():
        os.environ.setdefault(key, value)
    config._jaxpod_cache_dir = path


def pytest_unconfigure(config):
    path = getattr(config, "_jaxpod_cache_dir", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get("JAX_COMPILATION_CACHE_DIR") == path:
            del os.environ["JAX_COMPILATION_CACHE_DIR"]


# `xdist_group` names shared across modules: tests that compile the same programs run in one
# process, one after another, so the compilation cache serves every compile after the first.
SHARED_PREFIX = "shared:"


def _group_of(item) -> str:
    """The module's path (from the repository root), or `path@name` for a test marked
    `xdist_group(name)`: a module's own groups never merge with another module's, except the
    names starting with `SHARED_PREFIX`, which are one group wherever they are used."""
    path = item.nodeid.split("::")[0]
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return path
    name = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
    return name if name.startswith(SHARED_PREFIX) else f"{path}@{name}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Slow kinds imply `slow`; every test gets its one `xdist_group`; heavy groups first.

    Runs before the `-m` deselection and before xdist reads the `xdist_group` marks (with
    `--dist loadgroup` a group is one unit of work, handed out in this order when xdist is
    run with `--no-loadscope-reorder`)."""
    groups = {}
    for item in items:
        if item.nodeid.startswith(ENGINE_FOLDERS) or "lab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)
        groups[item.nodeid] = _group_of(item)
    for item in items:  # xdist joins every xdist_group mark it finds: keep exactly one
        for node in item.listchain():
            node.own_markers = [m for m in node.own_markers if m.name != "xdist_group"]
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(groups[item.nodeid], i)
    # stable: inside a group the collection order is kept
    items.sort(
        key=lambda it: (rank.get(groups[it.nodeid], len(rank)), first_seen[groups[it.nodeid]])
    )


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `-p no:xdist` runs without it
def pytest_xdist_node_collection_finished(node, ids):
    """The controller, under `--dist loadgroup`: every collected test must carry its group.

    xdist groups by a `@group` suffix its own collection hook writes into each node id; with
    pytest 9.2 that write no longer takes effect (pytest-xdist#1386) and every test silently
    becomes its own unit of work (module fixtures built on both workers, the shared groups'
    programs compiled twice). pyproject.toml pins a pytest that works; this turns a change of
    either package into a one-line stop instead of a slower suite."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    loose = [i for i in ids if _id_group(i) is None]
    if loose:
        import xdist

        pytest.exit(
            f"xdist's loadgroup did not group {loose[0]} (pytest {pytest.__version__}, "
            f"pytest-xdist {xdist.__version__}): install the versions pyproject.toml pins",
            returncode=4,
        )
    stale = _stale_heavy_first(node.config, ids)
    if stale:
        pytest.exit(
            f"tests/conftest.py HEAVY_FIRST names {stale[0]!r}, which is no group of the tests: "
            "rename it to the group's name or remove it",
            returncode=4,
        )


def _id_group(nodeid: str) -> str | None:
    """The group xdist wrote into a test id: what follows its first `@` after the test's
    parameters (None: no group)."""
    tail = nodeid.rsplit("]", 1)[-1]
    return tail.split("@", 1)[1] if "@" in tail else None


def _stale_heavy_first(config, ids: list[str]) -> list[str]:
    """`HEAVY_FIRST` names that are no group of a whole-suite run (no paths, `-m` or `-k`:
    `make test`, i.e. CI); such a name orders nothing, silently."""
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if not whole or config.getoption("markexpr") or config.getoption("keyword"):
        return []
    groups = {_id_group(i) for i in ids}
    return [name for name in HEAVY_FIRST if name not in groups]


def _reset_jax_cache_state() -> None:
    """jax memoizes "is the persistent cache used?" at the first compile; make it look again."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - the cache is only a speed-up
        return
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def xla_compilation_cache():
    """The session's persistent compilation cache directory, configured in this process.

    jax reads `JAX_COMPILATION_CACHE_DIR` when it is imported; if it was imported before
    `pytest_configure` set it (a plugin, `python -c`), the config is updated here."""
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if path and jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
        _reset_jax_cache_state()
    return path


@pytest.fixture(scope="session")
def tiny_cfg(xla_compilation_cache):
    """Factory: `tiny_cfg(*"key=value", mesh=(r, p, t), section__key=value)` -> Config."""
    return make_tiny_cfg


@pytest.fixture(name="mesh_for", scope="session")
def mesh_for_fixture(xla_compilation_cache):
    """Factory: `mesh_for(cfg)` -> the cfg's `Mesh` on `jax.devices()[:n]`."""
    return mesh_for


@pytest.fixture(scope="session")
def lab(tiny_cfg, mesh_for):
    """The equivalence lab (tests/helpers/lab.py): engines, steps and the plain reference,
    each computed once per test process; the measured errors are printed at the end (-s)."""
    from helpers.lab import Lab, print_measured

    yield Lab(tiny_cfg, mesh_for)
    print_measured()


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """The logdir of the tiny 4-step CLI run on 1 process x 8 devices (`helpers.cli.TINY4`):
    the reference the multi-process runs of tests/cli/test_multihost*.py are compared with
    (their xdist group, `helpers.cli.TWO_PROCESSES`, runs it once)."""
    from helpers.cli import TINY, TINY4, finish, start

    logdir = tmp_path_factory.mktemp("one-process") / "run"
    finish([start("train", TINY, *TINY4, "devices=8", f"train.logdir={logdir}")], timeout=300)
    return logdir


@pytest.fixture
def in_process_cli(monkeypatch):
    """`jaxpod.cli.main` called inside the test process: the CLI's process-wide error state
    (`jaxpod.errors.exit_on_user_error`) is undone afterwards."""
    from jaxpod import errors

    monkeypatch.setattr(errors, "_cli", dict(errors._cli))
