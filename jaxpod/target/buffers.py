"""Bytes per memory space of a compiled TPU program: what its buffer assignment puts in HBM.

`memory_analysis()` of an XLA:TPU program adds every memory space into its temporaries: the
chip's on-chip scratch (VMEM, SMEM: sized by the chip, a few MiB, held by any program)
beside HBM, and the host memory that offloaded state and activations live in (`cmem`: its
total is `host_argument_bytes + host_temp_bytes` in every offloaded program read). What must
fit in a chip's HBM is every allocation of the other memory spaces (arguments resident in
HBM, temporaries, constants, thread-local scratch), each once: on v5e, v5p and v6e the
`default` space, on v4 the `default` and `hbm` spaces together. XLA writes the total of each
space in its memory-usage report, which a compile dumps when asked (`xla_dump_to`, a compile
option of this compile only).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path

import jax

# The compile options that make XLA dump the optimized program's reports (text only).
DUMP_OPTIONS = {"xla_dump_hlo_as_text": True}
_SPACE = re.compile(r"^Memory Space: (\S+) \(color=(\d+)\)\nTotal bytes: (\d+)", re.MULTILINE)


def memory_spaces(report: str) -> dict[str, int]:
    """`{"default": bytes, "vmem": bytes, ...}`: the total of each memory space of XLA's
    memory-usage report (`*memory-usage-report.txt`)."""
    return {name: int(total) for name, _, total in _SPACE.findall(report)}


ON_CHIP = ("vmem", "smem")  # scratch memories inside the chip
HOST = ("cmem", "host")  # the host's memory (`pinned_host`)


def device_memory_bytes(spaces: dict[str, int]) -> int:
    """The bytes a program holds in the chip's HBM: every memory space but `ON_CHIP` and
    `HOST`."""
    return sum(n for name, n in spaces.items() if name not in (*ON_CHIP, *HOST))


@contextlib.contextmanager
def uncached():
    """jax's persistent compilation cache off for the compiles inside: a program read from
    it is not compiled, so nothing is dumped (its key leaves out the dump options), and an
    executable for compile-only devices cannot be loaded from it."""
    from jax._src import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def compile_with_spaces(
    lowered: jax.stages.Lowered, options: dict
) -> tuple[jax.stages.Compiled, dict[str, int]]:
    """`lowered` compiled with `options` (never served by jax's persistent cache: `uncached`),
    and its bytes per memory space (`memory_spaces`; empty where the backend writes no such
    report, as XLA:CPU)."""
    with tempfile.TemporaryDirectory(prefix="jaxpod-xla-dump-") as folder, uncached():
        compiled = lowered.compile(
            compiler_options={**options, **DUMP_OPTIONS, "xla_dump_to": folder}
        )
        reports = sorted(Path(folder).glob("*memory-usage-report.txt"))
        spaces = memory_spaces(reports[-1].read_text()) if reports else {}
    return compiled, spaces
