"""Rules and warnings at the edges: a step count no step counter holds is refused (it passed,
then overflowed in the prefetcher); settings that are legal but do nothing are named; README
calls tensor-sharded only the models the rules let shard."""

from __future__ import annotations

import pytest
from helpers import ROOT, make_tiny_cfg

from jaxpod.config import ConfigError
from jaxpod.config.rules import warnings


def test_skip_bubbles_where_there_are_none_to_skip_is_named():
    (none,) = warnings(make_tiny_cfg("train.skip_bubbles=true", mesh=(4, 1, 2)))
    assert none.startswith("train.skip_bubbles=true does nothing with mesh.pipeline=1")
    for kind in ("1f1b", "zb-h1"):
        cfg = make_tiny_cfg("train.skip_bubbles=true", f"train.pipeline_schedule={kind}")
        (unused,) = warnings(cfg)
        assert unused.startswith(f"train.skip_bubbles=true is not used by {kind} training")
    assert warnings(make_tiny_cfg("train.skip_bubbles=true")) == []  # gpipe on 2 stages


def test_phases_without_offloaded_params_say_where_the_stack_lives():
    (phases,) = warnings(make_tiny_cfg("memory.phases=2", mesh=(2, 1, 2)))
    assert phases.startswith("memory.phases=2 keeps the layer stack in host memory")
    offloaded = make_tiny_cfg("memory.phases=2", "memory.offload=[params]", mesh=(2, 1, 2))
    assert warnings(offloaded) == []


def test_more_steps_than_a_step_counter_holds_is_one_line():
    for steps in ("99999999999999999999", str(2**31)):
        with pytest.raises(ConfigError, match=rf"train.steps={steps} is more than a step counter"):
            make_tiny_cfg(f"train.steps={steps}")
    assert make_tiny_cfg(f"train.steps={2**31 - 1}").train.steps == 2**31 - 1


def test_the_readme_calls_tensor_sharded_only_the_models_the_rules_shard():
    """README's opening said every model is tensor-sharded; the rules refuse mesh.tensor>1
    for EfficientNet. Each model it names is called tensor-sharded, or not, as they decide."""
    opening = " ".join((ROOT / "README.md").read_text().split("\n\n")[1].split())
    models = opening.split("Flax NNX models")[1].split(";")[0]
    named = {"GPT": [], "BERT": ["model.vocab=264"], "EfficientNet": ["data.name=digits"]}
    said = {}
    for name in named:  # what the first "tensor-sharded" after its name says of it
        after = models[models.index(name) :]
        said[name] = not after[: after.index("tensor-sharded")].endswith("not ")
    for name, extra in named.items():
        try:
            make_tiny_cfg(f"model.name={name.lower()}", *extra, mesh=(1, 1, 2))
            shards = True
        except ConfigError as err:
            assert "mesh.tensor=2" in str(err), err
            shards = False
        assert said[name] == shards, (name, models)
