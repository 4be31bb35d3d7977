"""`jaxpod search --verify`: the top mappings of a search compiled for the TPU topology searched
on (XLA:TPU through libtpu, no TPU attached: `jaxpod.inspect.compile.compile_for_target`), XLA's
HBM bytes per chip beside the planner's for the same mapping. The search ranks by the planner;
this says how far to trust the bytes behind each rank, in the program XLA:TPU would run.
"""

from __future__ import annotations

from typing import TextIO

from jaxpod.errors import UserError
from jaxpod.inspect.search import mapping_maker

# what each compiled mapping reports (`jaxpod.inspect.compile.compile_step`'s keys)
KEYS = ("device_total_bytes", "planned_device_total_bytes", "planned_ratio", "compile_s")


def verify(
    config: str,
    overrides: list[str],
    target_text: str,
    ranked: list[dict],
    progress: TextIO | None = None,
) -> list[dict]:
    """`[{"device_total_bytes", "planned_device_total_bytes", "planned_ratio", "compile_s"}]`,
    one per mapping of `ranked` (the search's entries), each compiled for `target_text`."""
    from jaxpod.inspect.compile import compile_for_target
    from jaxpod.target.spec import parse_target

    target = parse_target(target_text)
    if target.platform != "tpu":
        raise UserError(f"--verify compiles for a TPU topology; --target {target_text} is none")
    make = mapping_maker(config, overrides, target.profile, target.chips)
    out = []
    for i, entry in enumerate(ranked, 1):
        if progress is not None:
            print(f"jaxpod: verifying mapping {i} of {len(ranked)}", file=progress, flush=True)
        r = compile_for_target(make(entry["overrides"]), target, progress)
        out.append({k: r[k] for k in KEYS})
    return out


def format_verified(verified: list[dict], target_text: str) -> str:
    """The verified mappings as lines, numbered as the search's."""
    lines = [f"compiled for {target_text} (XLA:TPU's HBM per chip beside the plan):"]
    for i, v in enumerate(verified, 1):
        xla, planned = v["device_total_bytes"] / 1e9, v["planned_device_total_bytes"] / 1e9
        lines.append(
            f"{i}. XLA:TPU {xla:.3f} GB, planned {planned:.3f} GB (planned/XLA "
            f"{v['planned_ratio']:.2f}), compiled in {v['compile_s']:.0f} s"
        )
    return "\n".join(lines)
