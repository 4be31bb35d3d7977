"""Process-level setup that must happen before jax starts (imports nothing from jax at import
time), and the compiler options that apply to XLA's CPU backend only."""

from __future__ import annotations

import glob
import os
from pathlib import Path

# XLA's CPU backend schedules for thread parallelism by default, holding independent work
# alive at once; a pod's compiler schedules for memory, and so must the emulation that
# plans it: a full-size preset's temporaries per device shrink up to ~3x (GPT-3 on POD256),
# and training on CPU is no slower.
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def virtual_cpu_flags(count: int, existing: str = "") -> str:
    """`existing` XLA flags with the device count set to `count` and, unless they already set
    it, the memory-minimising scheduler (`MEMORY_SCHEDULER`): the flags every jaxpod process
    (CLI, tests, benchmark workers) compiles with, so they all measure the same program."""
    flags = [f for f in existing.split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    if not any(f.split("=")[0] == MEMORY_SCHEDULER.split("=")[0] for f in flags):
        flags.append(MEMORY_SCHEDULER)
    return " ".join(flags)


def use_virtual_cpu_devices(count: int) -> None:
    """Ask XLA for `count` virtual CPU devices (ignored by TPU/GPU backends) with
    `virtual_cpu_flags`, and keep libtpu quiet where no TPU is attached (`quiet_tpu_runtime`).
    Must run before jax initialises its backend: the flags are read once, at start-up.
    """
    os.environ["XLA_FLAGS"] = virtual_cpu_flags(count, os.environ.get("XLA_FLAGS", ""))
    quiet_tpu_runtime()


# What a TPU chip reports in /sys/bus/pci/devices/*/{vendor,device} (v3 to TPU7x; the same
# table jax's own start-up reads)
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}

# With libtpu installed (it compiles `--target tpu-...` programs) but no TPU attached, the TPU
# runtime asks the cloud metadata server about TPU hosts and prints its failure at every jax
# start. These say "one host, this one" (a deviceless topology keeps its own host count);
# let several processes load libtpu at once (it locks a file for the chips they would share;
# with no chips there is nothing to share: parallel test workers and compiles); and keep the
# runtime's log files (/tmp/tpu_logs, gigabytes of compiler warnings for a large program)
# to fatal errors: a failed compile is an exception all the same.
QUIET_TPU_RUNTIME = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_HOST_BOUNDS": "1,1,1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_MIN_LOG_LEVEL": "3",
    "TPU_STDERR_LOG_LEVEL": "3",
}


def tpu_chips_attached(pci_root: str = "/sys/bus/pci/devices") -> int:
    """How many Google TPU chips this machine has on its PCI bus (as jax itself counts them)."""
    chips = 0
    for vendor in glob.glob(f"{pci_root}/*/vendor"):
        if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR:
            device = Path(vendor).with_name("device").read_text().strip()
            chips += device in TPU_PCI_DEVICES
    return chips


def quiet_tpu_runtime() -> None:
    """On a machine without TPU chips, set `QUIET_TPU_RUNTIME` (unless already set) so that
    libtpu starts silently; on a TPU VM change nothing (its runtime needs the real hosts)."""
    if tpu_chips_attached() == 0:
        for key, value in QUIET_TPU_RUNTIME.items():
            os.environ.setdefault(key, value)


def cpu_only(options: dict) -> dict:
    """`options` (XLA compiler options) when jax runs on its CPU backend, `{}` elsewhere: the
    LLVM levels jaxpod picks for programs that run once or are only read are XLA:CPU's."""
    import jax  # here, not at the top: this module is imported before jax may start

    return dict(options) if jax.default_backend() == "cpu" else {}


def backend_error(exc: BaseException):
    """jax's failure to start the platform `JAX_PLATFORMS` names (or any) as a one-line
    `UserError`, or None for any other error."""
    from jaxpod.errors import UserError, one_line

    text = str(exc)
    named = os.environ.get("JAX_PLATFORMS", "")
    if isinstance(exc, AssertionError) and _raised_in_jax_backends(exc):
        # jax skips a platform it sees no device of (cuda without an NVIDIA GPU), then
        # fails an assertion, with no message, that some backend started
        text = f"no backend started (no {named or 'accelerator'} device is visible)"
    elif "Unable to initialize backend" not in text:
        return None
    where = f"JAX_PLATFORMS={named}" if named else "jax"
    why = one_line(text.split(" (set JAX_PLATFORMS")[0], 240)
    return UserError(
        f"{where}: {why}; unset JAX_PLATFORMS or name a platform this machine has (cpu)"
    )


def _raised_in_jax_backends(exc: BaseException) -> bool:
    """Whether `exc` was raised in jax's `xla_bridge.backends()`, which starts the backends."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code if tb is not None else None
    return code is not None and code.co_name == "backends" and "xla_bridge" in code.co_filename
