"""A config loaded for a `--target`: the mesh checked against the target's chips, `devices`
set to them (so `mesh.replica=-1` fills from the target), and, for a plan, the target's
planner profile as `memory.device`. Used by `jaxpod compile --target` and `jaxpod plan
--target`; jax-free."""

from __future__ import annotations

from jaxpod.config import MAX_PLANNED_DEVICES, Config, load_config, peek
from jaxpod.errors import UserError
from jaxpod.target.spec import Target, check_compiles, check_mesh_fits, parse_target

MESH_AXES = ("replica", "pipeline", "tensor")


def load_for_target(
    config: str, overrides: list[str], text: str, *, profile: bool = False
) -> tuple[Target, Config]:
    """`(target, cfg)` for `--target text`: `devices` the target's chip count, after checking
    the mesh fits them; `profile`: plan on the target's device profile (`memory.device`),
    whatever the config file names (a `memory.device=` given beside it is refused)."""
    target = parse_target(text)
    if profile and any(o.split("=", 1)[0].strip() == "memory.device" for o in overrides):
        raise UserError(
            f"--target {text} plans on its profile {target.profile!r}; drop memory.device= "
            "or drop --target"
        )
    replica, pipeline, tensor = (peek(config, overrides, f"mesh.{a}") for a in MESH_AXES)
    if replica != -1:
        check_mesh_fits(target, replica * pipeline * tensor)
    extra = [f"devices={target.chips}"]
    if profile:
        extra.append(f"memory.device={target.profile}")
    cfg = load_config(config, [*overrides, *extra], max_devices=MAX_PLANNED_DEVICES)
    check_compiles(target, cfg)  # before the config's warnings: the refusal is the one line
    return target, cfg
