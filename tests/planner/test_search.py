"""`jaxpod search`: every mapping of a small pod enumerated, the fitting ones ranked by the
step-time model, each result what `plan` and `estimate` say of it alone."""

from __future__ import annotations

import itertools
import json

import pytest

from jaxpod.cli import main
from jaxpod.config import MAX_PLANNED_DEVICES, ConfigError, load_config
from jaxpod.config.load import config_maker
from jaxpod.inspect.estimate import estimate_config
from jaxpod.inspect.search import divisors, mappings, search
from jaxpod.parallel.schedules import KINDS
from jaxpod.planner.plan import plan
from jaxpod.planner.speed import get_speed

CONFIG = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def found():
    return search(CONFIG, [], "h100-80gb", 16, None)


def test_every_mapping_of_the_pod_is_considered(found):
    """tiny (4 layers, 4 heads) on 16 devices, global batch 32, against brute force: every
    (t, p, micro-batch, schedule, RTS) that validation accepts is considered, and nothing
    else (the search prunes with the divisibility rules validation enforces), each with
    every remat policy."""
    base = ["devices=16", "memory.device=h100-80gb", "mesh.replica=-1"]
    accepted = set()
    for t in divisors(16):
        for p in divisors(16 // t):
            r = 16 // (t * p)
            for mb in divisors(32 // r) if 32 % r == 0 else ():
                for kind, virtual, rts in itertools.product(KINDS, (1, 2, 3, 4), {1, r}):
                    mapping = _mapping(r, p, t, mb, 32 // r // mb, kind, virtual, rts)
                    if _validates(CONFIG, [*base, *mapping]):
                        accepted.add(mapping)
    cfg = load_config(CONFIG, base, max_devices=MAX_PLANNED_DEVICES)
    considered = [tuple(m) for m in mappings(cfg, 16, 32, get_speed("h100-80gb").fast_group)]
    assert {m for m in considered if "model.remat=none" in m} == accepted
    assert found["considered"] == len(considered) == 3 * len(accepted) == found["valid"]
    assert found["fitting"] == len(found["top"]) > 0


def _mapping(r, p, t, mb, accum, kind, virtual, rts) -> tuple[str, ...]:
    """The overrides `mappings` yields for these choices, with remat `none`."""
    return (
        *(f"mesh.{axis}={n}" for axis, n in (("replica", r), ("pipeline", p), ("tensor", t))),
        f"train.micro_batch={mb}",
        f"train.grad_accum={accum}",
        "train.global_batch=null",
        f"train.pipeline_schedule={kind}",
        f"train.virtual_stages={virtual}",
        "model.remat=none",
        f"memory.rts={rts}",
        f"memory.rts_optimizer={rts}",
    )


def _validates(config: str, overrides: list[str]) -> bool:
    try:
        load_config(config, overrides, max_devices=MAX_PLANNED_DEVICES)
    except ConfigError:
        return False
    return True


def test_the_ranking_is_what_plan_and_estimate_say_alone(found):
    times = [m["estimate"]["step_time_s"] for m in found["top"]]
    assert times == sorted(times)
    for m in found["top"][:3]:
        on = ["devices=16", "memory.device=h100-80gb", *m["overrides"]]
        cfg = load_config(CONFIG, on, max_devices=MAX_PLANNED_DEVICES)
        assert plan(cfg)["fits"]
        alone = estimate_config(cfg, "h100-80gb")["step_time_s"]
        assert alone == pytest.approx(m["estimate"]["step_time_s"])


def test_search_cli(capsys, in_process_cli):
    main(["search", CONFIG, "--target", "h100-80gb:16", "--top", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert len(out["top"]) == 2 and {"considered", "valid", "fitting"} <= set(out)
    with pytest.raises(SystemExit) as exit_:
        main(["search", CONFIG, "--target", "h100-80gb:16", "--top", "0"])
    assert exit_.value.code == 2


def test_config_maker_is_load_config():
    """`config_maker(path, base)(more)` reads the YAML once and gives what `load_config(path,
    [*base, *more])` gives, a refused mapping refused alike."""
    base = ["devices=16", "memory.device=h100-80gb", "mesh.replica=-1"]
    make = config_maker(CONFIG, base, max_devices=MAX_PLANNED_DEVICES)
    for more in ([], ["mesh.pipeline=4", "mesh.tensor=1"], ["mesh.tensor=4", "model.remat=full"]):
        assert make(more) == load_config(CONFIG, [*base, *more], max_devices=MAX_PLANNED_DEVICES)
    with pytest.raises(ConfigError, match="does not divide devices=16"):
        make(["mesh.pipeline=3"])


def test_a_shape_the_presets_mesh_cannot_split_is_searched():
    """The preset's own mesh (pipeline 2, tensor 2) divides neither 5 layers nor 3 heads; the
    search starts from no mapping, so it finds the ones that do."""
    shape = ["model.layers=5", "model.heads=3", "model.d_model=48", "model.d_ff=96"]
    found = search(CONFIG, shape, "h100-80gb", 8, 16)
    assert found["fitting"] > 0
    for m in found["top"]:
        mesh = dict(o.split("=") for o in m["overrides"] if o.startswith("mesh."))
        assert 5 % int(mesh["mesh.pipeline"]) == 0 and 3 % int(mesh["mesh.tensor"]) == 0


def test_verify_needs_a_tpu_topology(capsys, in_process_cli):
    with pytest.raises(SystemExit) as exit_:
        main(["search", CONFIG, "--target", "h100-80gb:16", "--verify"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--verify compiles for a TPU topology" in err[0]
