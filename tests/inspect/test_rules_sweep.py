"""Validation against the program, on seeded random small configs: every config the rules
accept (`jaxpod.config.divisibility` and the section checks) builds its engine and lowers its
train step and its eval step on the virtual CPU devices, from abstract inputs; every config
they refuse gets one line naming its fields. The fast lane draws `FAST` transformer configs,
the slow lane `SLOW` more and `VISION` EfficientNets, from one seed; there the first `RUN`
accepted fast draws also run a step and an evaluation on real arrays.

A draw starts from a mapping that mostly divides (a mesh of at most 8 devices, shapes that
split over it, a schedule with the virtual stages it takes) and then sets 0 to 3 fields to
any value of a wider range, so that most draws sit on the edge of one rule or another.
"""

from __future__ import annotations

import random
import re

import pytest
from helpers import TINY_VISION, make_tiny_cfg, mesh_for

from jaxpod.config import ConfigError
from jaxpod.config.schema import CHUNKED

SEED = 0
FAST, SLOW, VISION = 24, 160, 24  # transformers (fast, slow), EfficientNets (slow)
KINDS = ("gpipe", "circular", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
WIDE = {  # the values a field set off the mapping takes
    "model.layers": [1, 2, 3, 4, 6, 8],
    "model.heads": [1, 2, 3, 4, 6, 8],
    "model.d_model": [8, 12, 16, 24, 32],
    "model.d_ff": [8, 12, 16, 24, 32, 48],
    "model.vocab": [256, 257, 258, 260, 264, 270, 272],
    "model.seq_len": [3, 4, 6, 8, 9, 12, 17, 18, 34],
    "model.sequence_chunks": [1, 2, 3, 4],
    "model.sequence_parallel": ["true", "false"],
    "train.micro_batch": [1, 2, 3],
    "train.grad_accum": [1, 2, 3, 4, 5, 6, 8],
    "train.batch_parts": [1, 2, 3],
    "train.pipeline_group": ["null", 1, 2, 3, 4],
    "train.pipeline_schedule": list(KINDS),
    "train.virtual_stages": [1, 2, 3],
    "memory.rts": [1, 2, 4],
    "memory.rts_optimizer": ["null", 1, 2, 4],
    "memory.phases": [1, 2, 3],
    "memory.vocab_slices": [1, 2, 3, 4],
    "memory.mlp_panels": [1, 2, 3],
    "memory.stream": ["layer", "matrix"],
}
KEY = re.compile(r"\b(devices|(mesh|model|train|memory|optim|data|precision|parallel)\.\w+)")


def _mesh(rng: random.Random) -> dict:
    t = rng.choice([1, 1, 2, 2, 4])
    p = rng.choice([q for q in (1, 2, 2, 4) if q * t <= 8])
    r = rng.choice([q for q in (1, 2, 4, 8) if q * p * t <= 8])
    return {"devices": r * p * t, "mesh.replica": r, "mesh.pipeline": p, "mesh.tensor": t}


def _model(rng: random.Random, t: int, layers: int) -> dict:
    name = rng.choice(["gpt", "gpt", "bert"])
    heads = t * rng.choice([1, 2])
    vocab = 256 + t * rng.choice([1, 2, 4] if name == "bert" else [0, 2])  # BERT: a [MASK] id
    return {
        "model.name": name,
        "model.layers": layers,
        "model.heads": heads,
        "model.d_model": heads * rng.choice([4, 8]),
        "model.d_ff": t * rng.choice([8, 16]),
        "model.vocab": vocab,
        "model.seq_len": rng.choice([4, 6, 8, 12, 16, 18]),
        "model.sequence_chunks": rng.choice([1, 1, 2]),
        "model.sequence_parallel": rng.choice(["false", "true"]) if t > 1 else "false",
        "model.remat": rng.choice(["none", "full", "minimal", "attention", "comms"]),
    }


def draw(rng: random.Random) -> list[str]:
    """One config's overrides of configs/tiny.yaml (module docstring)."""
    mesh = _mesh(rng)
    r, p, t = mesh["mesh.replica"], mesh["mesh.pipeline"], mesh["mesh.tensor"]
    kind = "gpipe" if p == 1 else rng.choice(KINDS)
    virtual = 2 if kind in CHUNKED else 1
    per_stage = virtual * rng.choice([1, 2])
    model = _model(rng, t, p * per_stage)
    stream = "matrix" if model["model.remat"] != "none" and rng.random() < 0.3 else "layer"
    rts = rng.choice([d for d in (1, 2, 4) if r % d == 0])
    accum = p * rng.choice([1, 2]) if p > 1 else rng.choice([1, 2, 3])
    gpt = model["model.name"] == "gpt"  # BERT's loss takes no parts, its table no slices
    values = {
        **mesh,
        **model,
        "train.micro_batch": rng.choice([1, 2, 3]),
        "train.grad_accum": accum if rng.random() < 0.7 else rng.choice([1, 2, 3, 5, 6]),
        "train.global_batch": "null",
        "train.batch_parts": rng.choice([1, 2]) if gpt and accum % 2 == 0 else 1,
        "train.pipeline_group": rng.choice(["null", "null", p]),
        "train.pipeline_schedule": kind,
        "train.virtual_stages": virtual,
        "memory.rts": rts,
        "memory.rts_optimizer": rng.choice(["null", rts]),
        "memory.phases": rng.choice([1, 1, 2]) if per_stage % 2 == 0 else 1,
        "memory.vocab_slices": rng.choice([1, 2]) if gpt else 1,
        "memory.stream": stream,
        "memory.mlp_panels": 2 if stream == "matrix" and rng.random() < 0.5 else 1,
        "memory.offload": rng.choice(["[]", "[]", "[optimizer]", "[params]", "[params,optimizer]"]),
    }
    for key in rng.sample(sorted(WIDE), rng.choice([0, 1, 1, 2, 3])):
        values[key] = rng.choice(WIDE[key])
    return [f"{k}={v}" for k, v in values.items()]


def draw_vision(rng: random.Random) -> list[str]:
    """One config's overrides of configs/tiny.yaml: the tests' tiny EfficientNet
    (`helpers.TINY_VISION`) on 1 to 3 stages, its batch, schedule, image size and remat."""
    p = rng.choice([1, 2, 2, 3])
    r = rng.choice([q for q in (1, 2, 4) if q * p <= 8])
    splits = {1: "[]", 2: rng.choice(["[3a]", "[2a]"]), 3: "[2a,3a]"}[p]
    values = {
        "devices": r * p,
        "mesh.replica": r,
        "mesh.pipeline": p,
        "mesh.tensor": 1,
        "model.pipeline_splits": splits,
        "model.image_size": rng.choice([32, 33, 40, 48]),
        "model.remat": rng.choice(["none", "full"]),
        "train.micro_batch": rng.choice([1, 2, 3]),
        "train.grad_accum": rng.choice([1, 2, 3, 4]),
        "train.global_batch": "null",
        "train.batch_parts": rng.choice([1, 1, 2]),
        "train.pipeline_group": rng.choice(["null", "null", 1, 2]),
        "train.pipeline_schedule": rng.choice(["gpipe", "1f1b", "zb-h1"]) if p > 1 else "gpipe",
    }
    return [*TINY_VISION, *(f"{k}={v}" for k, v in values.items())]


_rng = random.Random(SEED)
DRAWS = [draw(_rng) for _ in range(FAST + SLOW)]
DRAWS += [draw_vision(_rng) for _ in range(VISION)]
CASES = [
    pytest.param(i, marks=() if i < FAST else pytest.mark.slow, id=f"draw{i}")
    for i in range(len(DRAWS))
]


def _lower(cfg) -> None:
    """Build `cfg`'s engine from abstract inputs and lower every step a run calls."""
    from jaxpod.inspect.compile import abstract_inputs

    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    engine.train_step.lower(*engine.updating_arguments(state, batch))
    if engine.first_part_step is not None:
        engine.first_part_step.lower(state, batch)
    engine.eval_step.lower(state.params, batch)


@pytest.mark.parametrize("case", CASES)
def test_what_validation_accepts_lowers_and_what_it_refuses_is_named(case):
    try:
        cfg = make_tiny_cfg(*DRAWS[case])
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message and KEY.search(message), message
        return
    _lower(cfg)


ONE_CALL = ["train.micro_batch=1", "train.grad_accum=1"]
SP = ["model.seq_len=34", "model.sequence_parallel=true", *ONE_CALL]


@pytest.mark.parametrize(
    "mesh, overrides, needle",
    [  # each passed validation, then crashed lowering its step ("scatter dimension ...")
        ((1, 2, 2), SP, "1*1*34/2 = 17 output tokens per pipeline pass (per tensor shard)"),
        ((1, 2, 2), [*SP, "train.pipeline_schedule=1f1b"], "17 output tokens of an evaluation"),
        ((1, 4, 1), ["model.seq_len=66", "train.pipeline_schedule=1f1b", *ONE_CALL], "1*1*66"),
    ],
    ids=["gpipe-sequence-parallel", "1f1b-evaluation-sequence-parallel", "1f1b-evaluation"],
)
def test_the_heads_spread_only_what_divides(mesh, overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make_tiny_cfg(*overrides, mesh=mesh)


def test_zb_v_keeps_its_heads_on_the_last_stage():
    """ZB-V trains and evaluates with the head on the last stage, a micro-batch at a time: no
    rule of the spread heads applies, and its step lowers."""
    zb_v = ["train.pipeline_schedule=zb-v", "train.virtual_stages=2", "model.layers=8"]
    _lower(make_tiny_cfg("model.seq_len=66", *ONE_CALL, *zb_v, mesh=(1, 4, 1)))


def test_the_fast_draws_cover_both_sides():
    """The fast lane's draws hold configs the rules accept and configs they refuse, and every
    pipeline schedule."""
    accepted = refused = 0
    for overrides in DRAWS[:FAST]:
        try:
            make_tiny_cfg(*overrides)
            accepted += 1
        except ConfigError:
            refused += 1
    assert accepted >= FAST // 3 and refused >= 2, (accepted, refused)
    kinds = {o.split("=")[1] for d in DRAWS[:FAST] for o in d if "pipeline_schedule=" in o}
    assert kinds == set(KINDS)


RUN = 12  # the accepted draws of the fast lane's that also run a step (slow lane)


def _accepted_fast_draws() -> list[int]:
    out = []
    for i in range(FAST):
        try:
            make_tiny_cfg(*DRAWS[i])
        except ConfigError:
            continue
        out.append(i)
    return out[:RUN]


def _concrete(abstract: tuple, shardings: tuple, seed: int) -> tuple:
    """A batch of `abstract`'s shapes in its shardings: token ids and labels 0 or 1 (valid for
    any vocabulary and class count), image bytes 0..255."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    high = lambda x: 256 if x.dtype == np.uint8 else 2  # noqa: E731
    values = [rng.integers(0, high(x), x.shape).astype(x.dtype) for x in abstract]
    return tuple(jax.device_put(v, s) for v, s in zip(values, shardings, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", _accepted_fast_draws())
def test_what_validation_accepts_runs_a_step(case):
    """Accepted draws run: the engine's own initial state, one optimizer step over the
    batch's parts and an evaluation, each loss finite."""
    import math

    from jaxpod.engine import build_engine
    from jaxpod.inspect.compile import abstract_inputs

    cfg = make_tiny_cfg(*DRAWS[case])
    mesh = mesh_for(cfg)
    _, _, abstract = abstract_inputs(cfg, mesh)
    engine, state = build_engine(cfg, mesh)
    parts = [_concrete(abstract, engine.batch_sharding, k) for k in range(cfg.train.batch_parts)]
    state, metrics = engine.run_step(state, parts)
    assert math.isfinite(float(metrics["loss"])), DRAWS[case]
    out = engine.eval_step(state.params, parts[0])
    assert all(math.isfinite(float(v)) for v in out.values()), DRAWS[case]
