"""JAX's multi-controller runtime: one process per host (or several on one machine).

Every process runs the same program. `initialize` connects the processes through the
coordinator (process 0 hosts it) *before* jax creates its backend; from then on
`jax.devices()` lists every process's devices and one `Mesh` spans them all, while each
process only touches its own (`jax.local_devices()`). On CPU the processes exchange collective
data with gloo.

How the rest of jaxpod behaves with several processes:

- `devices` in the config counts the virtual CPU devices of *each* process; the loaded
  `Config` also knows the process count (`load_config(..., processes=N)`), and the mesh must
  multiply to `devices × processes` (`Config.total_devices`).
- Batches are built with `jax.make_array_from_callback` (`Task.batch`), which calls the
  callback only for this process's devices: each process reads only its own rows, and the
  global array is assembled without any process seeing the others' data.
- Scalars (loss, norms, val loss) come out of the step replicated on every device, so each
  process reads them locally; only process 0 writes the run record and prints.
- Checkpoints: every process calls orbax's save/restore on the shared logdir; orbax writes
  each process's shards and commits once all are done. A URL logdir needs no shared
  filesystem: each process saves into its own copy (`jaxpod.run.shardsync`).

This module imports jax lazily: the CLI parses arguments and validates them before jax starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxpod.config import Config, load_config, peek
from jaxpod.errors import UserError

DEFAULT_INIT_TIMEOUT = 60  # seconds to wait for every process to reach the coordinator


@dataclass(frozen=True)
class DistributedSpec:
    """How to join the multi-controller runtime (None of it: a single process).

    `auto=True` lets `jax.distributed.initialize()` detect everything from the cluster
    environment (SLURM, Cloud TPU, Open MPI, `JAX_COORDINATOR_ADDRESS`, ...).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    init_timeout: int = DEFAULT_INIT_TIMEOUT

    @property
    def enabled(self) -> bool:
        """True when this process is one of several (explicit flags or auto-detection)."""
        return self.auto or self.coordinator is not None


def check_spec(spec: DistributedSpec) -> None:
    """One-line `UserError` for inconsistent flags (before anything starts)."""
    explicit = (spec.coordinator, spec.num_processes, spec.process_id)
    if spec.auto:
        if any(v is not None for v in explicit):
            raise UserError(
                "--distributed auto detects the coordinator and process ids itself; "
                "drop --coordinator/--num-processes/--process-id, or drop --distributed auto"
            )
    elif any(v is not None for v in explicit) and None in explicit:
        raise UserError(
            "--coordinator HOST:PORT, --num-processes N and --process-id I go together; "
            "give all three (or --distributed auto on a cluster)"
        )
    if spec.coordinator is not None and not re.fullmatch(r".+:\d{1,5}", spec.coordinator):
        raise UserError(
            f"--coordinator {spec.coordinator!r} is not HOST:PORT (e.g. --coordinator "
            "10.0.0.1:1234, the address of process 0)"
        )
    if spec.num_processes is not None and spec.num_processes < 1:
        raise UserError(f"--num-processes {spec.num_processes} must be >= 1")
    if spec.process_id is not None and not 0 <= spec.process_id < (spec.num_processes or 1):
        raise UserError(
            f"--process-id {spec.process_id} must be between 0 and --num-processes - 1 = "
            f"{(spec.num_processes or 1) - 1}"
        )
    if spec.init_timeout < 1:
        raise UserError(f"--init-timeout {spec.init_timeout} must be >= 1 second")


def initialize(spec: DistributedSpec) -> None:
    """Join the runtime described by `spec` (no-op for a single process).

    Must run after `XLA_FLAGS` is set and before any other jax call. Raises a one-line
    `UserError` if the coordinator cannot be reached within `spec.init_timeout` seconds.
    """
    if not spec.enabled:
        return
    import jax

    # gloo is the default in this jax; set it explicitly so CPU collectives across processes
    # never depend on the default (ignored on TPU/GPU, which use their own interconnect).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = "the coordinator found in the cluster environment"
    try:
        if spec.auto:
            jax.distributed.initialize(initialization_timeout=spec.init_timeout)
        else:
            where = f"coordinator {spec.coordinator}"
            jax.distributed.initialize(
                coordinator_address=spec.coordinator,
                num_processes=spec.num_processes,
                process_id=spec.process_id,
                initialization_timeout=spec.init_timeout,
            )
    except ValueError as exc:
        if spec.auto and "should be defined" in str(exc):
            raise UserError(
                "--distributed auto found no cluster environment (SLURM, Cloud TPU, Open MPI, "
                "JAX_COORDINATOR_ADDRESS); run it under srun / on every TPU worker, or give "
                "--coordinator, --num-processes and --process-id"
            ) from None
        raise _join_error(where, spec, exc) from None
    except Exception as exc:  # jaxlib raises XlaRuntimeError / RuntimeError
        raise _join_error(where, spec, exc) from None


def _join_error(where: str, spec: DistributedSpec, exc: Exception) -> UserError:
    text = " ".join(str(exc).split())[:200]
    return UserError(
        f"cannot join the distributed runtime through {where} within {spec.init_timeout} s "
        f"({type(exc).__name__}: {text}); start process 0 (it hosts the coordinator) and "
        "check HOST:PORT, or raise --init-timeout"
    )


def process_count() -> int:
    """Processes in the runtime (1 without `initialize`); starts jax's backend if needed."""
    import jax

    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0, the one that writes the run record and prints."""
    import jax

    return jax.process_index() == 0


def from_process_0(value: int) -> int:
    """Process 0's `value` on every process (a collective: every process calls it, with any
    value), e.g. the checkpoint process 0 pulled for a URL run directory."""
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def per_process_devices(config: str, overrides: list[str]) -> int:
    """The `devices` each process has (the last `devices=` override, else the YAML's, else the
    default), read by the config loader before the process count is known: the file, keys
    and value are checked (one-line `ConfigError`), the mesh not yet."""
    return peek(config, overrides, "devices")


def load_run_config(config: str, overrides: list[str], spec: DistributedSpec) -> Config:
    """Validate the config, set up this process's devices and join the runtime, in that order.

    `devices` counts each process's virtual CPU devices; the config is loaded with the
    process count (`processes`), so the mesh is validated against `devices × processes`. With
    explicit flags everything is validated before jax starts; with `--distributed auto` the
    process count is only known after joining (before it, only `devices` is read). An empty
    config file is refused: a run of every default is never what was meant.
    """
    from jaxpod.platform import use_virtual_cpu_devices

    def load(processes: int) -> Config:
        return load_config(config, overrides, processes=processes, allow_empty=False)

    check_spec(spec)
    if not spec.enabled:
        cfg = load(1)
        use_virtual_cpu_devices(cfg.devices)  # before jax starts
        return cfg
    cfg = None if spec.auto else load(spec.num_processes)
    per = cfg.devices if cfg is not None else per_process_devices(config, overrides)
    use_virtual_cpu_devices(max(per, 1))  # before jax starts; validation names a bad count
    if spec.process_id not in (None, 0):
        wait_for_coordinator(spec.coordinator, spec.init_timeout)
    initialize(spec)
    return cfg if cfg is not None else load(process_count())


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Wait until `address` (HOST:PORT) accepts TCP connections; one-line `UserError` if it
    does not within `timeout` seconds.

    jax's own client aborts the whole process (a C++ fatal error, no Python exception) when it
    cannot register in time; probing first turns the common case, an unreachable or not yet
    started coordinator, into a clean error.
    """
    import socket
    import time

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    why = "no answer"
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() >= deadline:
            raise UserError(
                f"coordinator {address} not reachable within {timeout:g} s ({why}); start "
                "process 0 (it hosts the coordinator) and check --coordinator HOST:PORT, or "
                "raise --init-timeout"
            )
        time.sleep(0.25)
