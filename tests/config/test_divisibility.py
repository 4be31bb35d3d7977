"""The one table of divisibility rules: each rule reads only the fields it names (what lets a
partial mapping be checked), a partial mapping is checked as far as it goes, and the rules
run in order, each after those it relies on."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from helpers import make_tiny_cfg

from jaxpod.config import ConfigError
from jaxpod.config.divisibility import FIELDS, RULES, accepts, first_broken, sizes


class _Only(Mapping):
    """The values of `fields` only: reading any other key fails the test."""

    def __init__(self, values: Mapping, fields: tuple[str, ...]):
        self.values, self.fields = values, fields

    def __getitem__(self, key):
        assert key in self.fields, f"reads {key}, which it does not name"
        return self.values[key]

    def __iter__(self):
        return iter(self.fields)

    def __len__(self):
        return len(self.fields)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.sequence_parallel=true", "train.pipeline_group=2", "train.batch_parts=2"),
        ("train.pipeline_schedule=circular", "train.virtual_stages=2", "memory.rts=2"),
        ("model.name=bert", "model.vocab=258", "train.pipeline_schedule=1f1b"),
    ],
)
def test_each_rule_reads_only_the_fields_it_names(overrides):
    values = sizes(make_tiny_cfg(*overrides))
    assert set(values) == set(FIELDS)
    for rule in RULES:
        assert rule.check(_Only(values, rule.fields)) is None, rule.check.__name__


def test_a_partial_mapping_is_checked_as_far_as_it_goes():
    model = {"model.name": "gpt", "model.heads": 4, "model.d_ff": 256, "model.vocab": 256}
    assert accepts(model)  # no rule has all its fields
    assert first_broken({**model, "mesh.tensor": 3}) == (
        "mesh.tensor=3 does not divide model.heads=4; use a mesh.tensor that divides it or a "
        "multiple of 3"
    )
    assert accepts({**model, "mesh.tensor": 2})


def test_a_rule_runs_after_those_it_relies_on():
    """More parts than micro-batches: the parts' rule answers, before the passes' rule would
    divide by the zero micro-batches a part gets."""
    with pytest.raises(ConfigError, match="train.batch_parts=3 does not divide train.grad_accum=2"):
        make_tiny_cfg("train.batch_parts=3", "train.grad_accum=2")
