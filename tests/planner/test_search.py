"""`jaxpod search`: every mapping of a small pod enumerated, the fitting ones ranked by the
step-time model, each result what `plan` and `estimate` say of it alone."""

from __future__ import annotations

import json

import pytest

from jaxpod.cli import main
from jaxpod.config import MAX_PLANNED_DEVICES, load_config
from jaxpod.inspect.estimate import estimate_config
from jaxpod.inspect.search import divisors, search
from jaxpod.planner.plan import plan

CONFIG = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def found():
    return search(CONFIG, [], "h100-80gb", 16, None)


def test_every_mapping_of_the_pod_is_considered(found):
    """tiny (4 layers, 4 heads) on 16 devices, global batch 32 (its 2 x 4 per replica on
    its 4 replicas there): t in {1, 2, 4}, p in {1, 2, 4}, each micro-batch dividing a
    replica's share, each schedule, remat and RTS choice."""
    expected = 0
    for t in (1, 2, 4):
        for p in (1, 2, 4):
            r = 16 // (t * p)
            if 32 % r:
                continue
            per = 32 // r
            for mb in divisors(per):
                accum = per // mb
                chunks = 4 % (2 * p) == 0  # zb-v; circular, interleaved 1f1b: and accum % p
                kinds = 1 if p == 1 else 3 + chunks * (1 + 2 * (accum % p == 0))
                expected += kinds * 3 * len({1, r})
    assert found["considered"] == expected
    assert found["fitting"] == len(found["top"]) > 0


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
