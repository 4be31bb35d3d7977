"""Tests for jaxpod.config: loading, overrides, resolution, validation messages. No jax here."""

import ast
import dataclasses
import subprocess
import sys
import typing

import pytest
import yaml
from helpers import ROOT

from jaxpod.config import (
    CHOICES,
    DTYPES,
    IMAGE_DATA,
    LIST_CHOICES,
    TEXT_DATA,
    Config,
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    parse_bytes,
    peek,
    with_overrides,
)
from jaxpod.config.kinds import KINDS
from jaxpod.config.schema import SECTIONS

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
TINY = ROOT / "configs" / "tiny.yaml"


def test_defaults_resolve():
    cfg = load_config(None)
    assert cfg.devices == 8
    assert cfg.mesh.shape == (8, 1, 1)
    assert cfg.train.grad_accum == 1
    assert cfg.train.global_batch == cfg.global_batch == 4 * 8
    assert cfg.tokens_per_step == 32 * cfg.model.seq_len
    assert config_from_dict({}) == cfg


@pytest.mark.parametrize(
    ("pipeline", "tensor", "replica"), [(1, 1, 8), (2, 1, 4), (2, 2, 2), (1, 8, 1)]
)
def test_replica_fills_from_devices(pipeline, tensor, replica):
    cfg = load_config(None, [f"mesh.pipeline={pipeline}", f"mesh.tensor={tensor}", "model.heads=8"])
    assert cfg.mesh.replica == replica


def test_unresolved_config_has_no_global_batch():
    with pytest.raises(ValueError):
        _ = Config().global_batch


def test_choices_table_matches_defaults():
    assert set(CHOICES) == {
        "model.name",
        "model.remat",
        "model.variant",
        "model.norm",
        "model.mlp",
        "model.positions",
        "optim.name",
        "optim.lr_schedule",
        "optim.moments",
        "train.pipeline_schedule",
        "parallel.grad_allreduce",
        "data.name",
        "precision.params",
        "precision.compute",
        "precision.master",
        "precision.loss_scale",
        "memory.device",
        "memory.stream",
    }
    default = Config()
    for key, options in CHOICES.items():
        section, name = key.split(".")
        assert getattr(getattr(default, section), name) in options


def test_tiny_preset_values():
    cfg = load_config(TINY)
    assert cfg.mesh.shape == (2, 2, 2)
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.global_batch) == (2, 4, 16)
    assert cfg.optim.lr == pytest.approx(3e-3)
    assert cfg.train.logdir == "runs/tiny"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_presets_load_and_round_trip(path):
    cfg = load_config(path)
    assert cfg.mesh.replica * cfg.mesh.pipeline * cfg.mesh.tensor == cfg.devices
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_presets_exist():
    assert {p.name for p in PRESETS} >= {"tiny.yaml", "demo.yaml"}


def test_yaml_scalar_overrides():
    cfg = load_config(
        TINY,
        [
            "optim.lr=3e-4",  # PyYAML reads this as a string; it must become a float
            "optim.weight_decay=1",  # int -> float
            "model.tie_embeddings=false",
            "data.path=null",
            "train.logdir=runs/x y",
            "train.seed=7",
        ],
    )
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.weight_decay == 1.0 and isinstance(cfg.optim.weight_decay, float)
    assert cfg.model.tie_embeddings is False
    assert cfg.data.path is None
    assert cfg.train.logdir == "runs/x y"
    assert cfg.train.seed == 7


def test_float_strings_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 3e-4, grad_clip: 0}\n")
    cfg = load_config(path)
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.optim.grad_clip == 0.0


def test_string_fields_keep_override_text():
    cfg = load_config(None, ["train.logdir=2024", "data.name=text-files", "data.path=123"])
    assert cfg.train.logdir == "2024"
    assert cfg.data.path == "123"


def test_text_files_path():
    cfg = load_config(None, ["data.name=text-files", "data.path=/some/dir"])
    assert cfg.data.path == "/some/dir"


def test_overrides_any_order_and_last_wins():
    a = load_config(TINY, ["mesh.tensor=1", "mesh.replica=4"])
    b = load_config(TINY, ["mesh.replica=4", "mesh.tensor=1"])
    assert a == b and a.mesh.shape == (4, 2, 1)
    assert load_config(None, ["train.steps=5", "train.steps=9"]).train.steps == 9


def test_global_batch_derives_grad_accum():
    cfg = load_config(None, ["train.global_batch=64"])
    assert (cfg.train.micro_batch, cfg.mesh.replica, cfg.train.grad_accum) == (4, 8, 2)
    same = load_config(None, ["train.global_batch=64", "train.grad_accum=2"])
    assert same == cfg


def test_round_trip_non_default():
    cfg = load_config(
        TINY,
        ["optim.name=sgd", "model.remat=full", "train.grad_accum=null", "train.global_batch=32"],
    )
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_frozen():
    cfg = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.devices = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.layers = 2  # type: ignore[misc]


def test_with_overrides_refills_derived_sizes():
    cfg = load_config(TINY)
    assert with_overrides(cfg, {}) == cfg
    narrower = with_overrides(cfg, {"mesh.tensor": 1})
    assert narrower.mesh.shape == (4, 2, 1)
    assert narrower.train.grad_accum == 4 and narrower.global_batch == 2 * 4 * 4
    assert with_overrides(cfg, ["mesh.tensor=1"]) == narrower
    fixed = with_overrides(cfg, {"train.global_batch": 32})
    assert fixed.train.grad_accum == 8
    assert with_overrides(cfg, {"optim.lr": "1e-2"}).optim.lr == pytest.approx(1e-2)
    assert cfg.mesh.tensor == 2  # the original is untouched


def test_with_overrides_validates():
    with pytest.raises(ConfigError, match="model.layers"):
        with_overrides(load_config(TINY), {"model.layers": 3})
    with pytest.raises(ConfigError, match="unknown config key 'mesh.tensr'"):
        with_overrides(load_config(TINY), {"mesh.tensr": 2})


def _check_message(exc: pytest.ExceptionInfo, expected: tuple[str, ...]) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for part in expected:
        assert part in msg, (part, msg)


BAD_OVERRIDES = [
    # keys and syntax
    (["model.layer=4"], ("unknown config key 'model.layer'; did you mean 'model.layers'?",)),
    (["model.zzzzzz=1"], ("unknown config key 'model.zzzzzz'", "valid keys in model: name, ")),
    (["modle.layers=4"], ("did you mean 'model.layers'?",)),
    (["devics=4"], ("unknown config key 'devics'; did you mean 'devices'?",)),
    (["qqqqqq=4"], ("unknown config key 'qqqqqq'", "valid top-level keys: devices, mesh")),
    (["model.layers.x=1"], ("unknown config key 'model.layers.x'",)),
    (["abc"], ("override 'abc' is not KEY=VALUE (e.g. mesh.tensor=2)",)),
    (["=3"], ("is not KEY=VALUE",)),
    (["model=3"], ("section 'model'",)),
    (["model.name=[oops"], ("model.name", "does not parse")),
    # types
    (["model.layers=abc"], ("model.layers='abc' must be an integer",)),
    (["model.layers=4.5"], ("model.layers=4.5 must be an integer",)),
    (["model.layers=true"], ("model.layers=True must be an integer",)),
    (["train.grad_accum=x"], ("train.grad_accum='x' must be an integer",)),
    (["optim.lr=abc"], ("optim.lr='abc' must be a number",)),
    (["optim.lr=true"], ("optim.lr=True must be a number",)),
    (["optim.lr=.inf"], ("optim.lr=inf must be a finite number",)),
    (["model.tie_embeddings=maybe"], ("model.tie_embeddings='maybe' must be true or false",)),
    (["data.path=[1, 2]"], ("data.path=[1, 2] must be a string or null",)),
    # choices
    (["model.remat=fast"], ("model.remat='fast' is not one of none, full, minimal, attention",)),
    (["model.remat=off"], ("model.remat='off' is not one of",)),
    (["model.name=llama"], ("model.name='llama' is not one of gpt, bert, efficientnet",)),
    (["optim.name=adam"], ("optim.name='adam' is not one of sgd, adamw, lamb, lars",)),
    (
        ["optim.lr_schedule=linear"],
        ("optim.lr_schedule='linear' is not one of constant, cosine, poly",),
    ),
    (["data.name=mnist"], ("data.name='mnist' is not one of stdlib-code, synthetic, text-files",)),
    (["precision.params=fp16"], ("precision.params='fp16' is not one of float32, float16, bf",)),
    (["precision.compute=int8"], ("precision.compute='int8' is not one of float32",)),
    (["precision.master=float16"], ("precision.master='float16' is not one of float32, same-",)),
    (["precision.loss_scale=auto"], ("precision.loss_scale='auto' is not one of none, static",)),
    (["memory.device=ipu"], ("memory.device='ipu' is not one of cpu, ipu-gc200, a100-40gb",)),
    (["memory.offload=[gradients]"], ("memory.offload item 'gradients' is not one of optim",)),
    (["memory.offload=[7]"], ("memory.offload[0]=7 must be a string",)),
    (["memory.offload={a: 1}"], ("memory.offload={'a': 1} must be a list",)),
    (["memory.device_budget=lots"], ("memory.device_budget='lots' is not a size; use e.g.",)),
    (["memory.device_budget=0MB"], ("memory.device_budget='0MB' must be > 0",)),
    (["memory.rts=3"], ("memory.rts=3 does not divide mesh.replica=8; use a divisor of 8",)),
    (["memory.rts_optimizer=16"], ("memory.rts_optimizer=16 does not divide mesh.replica=8",)),
    (["model.name=bert"], ("model.vocab=256: BERT needs the 256 byte values plus a [MASK] id",)),
    (
        ["model.name=bert", "mesh.tensor=2", "model.heads=8"],
        ("use model.vocab>=257 divisible by mesh.tensor=2, e.g. 258",),
    ),
    (
        ["memory.rts=2", "memory.rts_optimizer=3", "devices=6"],
        ("memory.rts=2 and memory.rts_optimizer=3 must divide one another",),
    ),
    (["memory.phases=5"], ("memory.phases=5 is more than model.layers=4; use fewer",)),
    (["memory.phases=3"], ("memory.phases=3 does not divide the 4 layers of each pipeline",)),
    (
        ["memory.stream=matrix", "model.remat=none"],
        ("memory.stream=matrix", "it needs a remat policy: set model.remat=full"),
    ),
    (["memory.stream=tensor"], ("memory.stream='tensor' is not one of layer, matrix",)),
    (["memory.mlp_panels=2"], ("memory.mlp_panels=2 streams the MLP's matrices in panels",)),
    (
        ["memory.stream=matrix", "model.remat=full", "memory.mlp_panels=3"],
        ("memory.mlp_panels=3 does not divide the 256 hidden units per tensor shard",),
    ),
    (["memory.vocab_slices=3"], ("memory.vocab_slices=3 does not divide the 256 table rows",)),
    (["memory.vocab_slices=0"], ("memory.vocab_slices=0 must be >= 1",)),
    (
        ["model.name=bert", "model.vocab=264", "memory.vocab_slices=2"],
        ("memory.vocab_slices=2 slices GPT's token table; model.name=bert uses its table whole",),
    ),
    (["train.profile_steps=[5]"], ("train.profile_steps=[5] must be [start, stop] with",)),
    (["train.profile_steps=[5,2]"], ("train.profile_steps=[5, 2] must be [start, stop]",)),
    (["train.profile_steps=[a,b]"], ("train.profile_steps[0]='a' must be an integer",)),
    (["model.pipeline_splits=[4a]"], ("model.pipeline_splits=['4a'] is for model.name=eff",)),
    (["data.name=digits"], ("data.name=digits is images but model.name=gpt reads tokens",)),
    (["data.name=image-folder"], ("data.name=image-folder needs data.path=DIR",)),
    *[
        (["model.name=efficientnet", "data.name=digits", *extra], expected)
        for extra, expected in [
            (["mesh.tensor=2"], ("mesh.tensor=2: model.name=efficientnet is pipelined",)),
            (["mesh.pipeline=2"], ("model.pipeline_splits=[] names 0 stage boundaries but",)),
            (["model.pipeline_splits=[4a]"], ("names 1 stage boundaries but mesh.pipeline=1",)),
            (["data.name=stdlib-code"], ("data.name=stdlib-code is text but model.name=eff",)),
            (["model.image_size=16"], ("model.image_size=16 must be >= 32",)),
            (["model.width_mult=0"], ("model.width_mult=0.0 must be > 0",)),
            (["memory.phases=2"], ("memory.phases/rts/offload/stream/mlp_panels/vocab_slices",)),
            (["memory.vocab_slices=2"], ("leave them at 1/1/[]/layer/1/1 for model.name=eff",)),
            # pipeline_splits name blocks of the variant (at its depth), once each, in order
            (
                ["mesh.pipeline=2", "model.pipeline_splits=[9z]"],
                (
                    "model.pipeline_splits=['9z']: '9z' is not a block of model.variant=b0; "
                    "valid block names: 1a, 2a-2b, 3a-3b, 4a-4c, 5a-5c, 6a-6d, 7a",
                ),
            ),
            (
                ["mesh.pipeline=2", "model.pipeline_splits=4"],
                ("model.pipeline_splits=['4']: '4' is not a block of model.variant=b0",),
            ),
            (
                ["mesh.pipeline=2", "model.depth_mult=0.5", "model.pipeline_splits=[4c]"],
                (
                    "'4c' is not a block of model.variant=b0 at model.depth_mult=0.5; valid "
                    "block names: 1a, 2a, 3a, 4a, 4b, 5a, 5b, 6a, 6b, 7a",
                ),
            ),
            (
                ["mesh.pipeline=2", "model.block_groups=3", "model.pipeline_splits=[4a]"],
                (
                    "'4a' is not a block of model.variant=b0 with model.block_groups=3; valid "
                    "block names: 1a, 2a, 2b, 3a, 3b",
                ),
            ),
            (["model.block_groups=8"], ("model.block_groups=8 must be between 1 and 7",)),
            (["model.block_groups=0"], ("model.block_groups=0 must be between 1 and 7",)),
            (
                ["mesh.pipeline=3", "devices=6", "model.pipeline_splits=[4a,4a]"],
                ("model.pipeline_splits=['4a', '4a'] names block 4a twice", "valid block names"),
            ),
            (
                ["mesh.pipeline=3", "devices=6", "model.pipeline_splits=[5a,3a]"],
                (
                    "model.pipeline_splits=['5a', '3a'] is out of order",
                    "e.g. model.pipeline_splits=[3a,5a]",
                ),
            ),
            (
                ["model.depth_mult=10"],
                ("model.depth_mult=10 scales the 4-block group past 26 blocks", "depth_mult<=6.5"),
            ),
            (["model.depth_mult=1e308"], ("model.depth_mult=1e+308 scales the 4-block group",)),
            (["model.width_mult=1e306"], ("model.width_mult=1e+306 is too large",)),
            (
                ["train.micro_batch=1000000000"],
                ("train.micro_batch=1000000000 makes 8,000,000,000 images a step", "int32"),
            ),
        ]
    ],
    # ranges
    (["devices=0"], ("devices=0 must be between 1 and 256",)),
    (["devices=512"], ("devices=512 must be between 1 and 256",)),
    (["mesh.replica=0"], ("mesh.replica=0 must be >= 1, or -1",)),
    (["mesh.replica=-2"], ("mesh.replica=-2",)),
    *[
        ([f"{key}=0"], (f"{key}=0 must be >= 1",))
        for key in (
            "mesh.pipeline mesh.tensor model.layers model.d_model model.heads model.d_ff "
            "model.seq_len model.vocab train.steps train.micro_batch train.grad_accum "
            "train.global_batch train.log_every train.eval_batches train.keep_checkpoints "
            "train.pipeline_group data.workers"
        ).split()
    ],
    (["train.seed=-1"], ("train.seed=-1 must be in [0, 2**32)",)),
    (["train.seed=4294967296"], ("train.seed=4294967296 must be in [0, 2**32)",)),
    (["train.seed=99999999999999999999"], ("train.seed=99999999999999999999 must be in [0",)),
    (["train.eval_every=-1"], ("train.eval_every=-1 must be >= 0",)),
    (["train.checkpoint_every=-1"], ("train.checkpoint_every=-1 must be >= 0",)),
    (["optim.warmup_steps=-1"], ("optim.warmup_steps=-1 must be >= 0",)),
    (["optim.weight_decay=-0.1"], ("optim.weight_decay=-0.1 must be >= 0",)),
    (["optim.grad_clip=-1"], ("optim.grad_clip=-1.0 must be >= 0",)),
    (["optim.b2=1"], ("optim.b2=1.0 must be in [0, 1)",)),
    (["optim.lr=0"], ("optim.lr=0.0 must be > 0",)),
    (["optim.lr=-1e-3"], ("optim.lr=-0.001 must be > 0",)),
    (["data.val_fraction=0"], ("data.val_fraction=0.0 must be between 0 and 1",)),
    (["data.val_fraction=1"], ("data.val_fraction=1.0 must be between 0 and 1",)),
    (['train.logdir=""'], ("train.logdir", "must not be empty")),
    # mesh vs devices
    (
        ["mesh.pipeline=2", "mesh.tensor=3", "model.heads=6", "model.d_model=60"],
        ("mesh.pipeline*mesh.tensor=6 does not divide devices=8; change",),
    ),
    (
        ["mesh.replica=2", "mesh.pipeline=2"],
        ("mesh replica*pipeline*tensor = 2*2*1 = 4 does not match devices=8; set mesh.replica=-1",),
    ),
    # model shapes
    (
        ["model.d_model=100", "model.heads=8"],
        ("model.d_model=100 is not divisible by model.heads=8",),
    ),
    (
        ["model.layers=5", "mesh.pipeline=2"],
        ("model.layers=5 does not divide into mesh.pipeline=2 stages; use a multiple of 2",),
    ),
    (["mesh.tensor=8"], ("mesh.tensor=8 does not divide model.heads=4",)),
    (
        ["model.sequence_chunks=3"],
        ("model.sequence_chunks=3 does not divide model.seq_len=", "use a divisor of"),
    ),
    (["model.sequence_chunks=0"], ("model.sequence_chunks=0 must be >= 1",)),
    (
        ["mesh.tensor=2", "model.seq_len=63", "model.sequence_parallel=true"],
        ("model.sequence_parallel=true splits model.seq_len=63 over mesh.tensor=2",),
    ),
    (
        ["mesh.tensor=8", "model.heads=8", "model.d_ff=260"],
        ("mesh.tensor=8 does not divide model.d_ff=260",),
    ),
    (
        ["mesh.tensor=8", "model.heads=8", "model.vocab=260"],
        ("mesh.tensor=8 does not divide model.vocab=260",),
    ),
    # batch
    (
        ["mesh.pipeline=2", "mesh.tensor=2", "train.global_batch=10"],
        ("train.global_batch=10 is not divisible by train.micro_batch*mesh.replica = 4*2 = 8",),
    ),
    (
        ["train.global_batch=64", "train.grad_accum=3"],
        ("train.grad_accum=3", "train.global_batch=64", "grad_accum=2"),
    ),
    (
        ["train.grad_accum=4", "train.pipeline_group=3"],
        ("train.pipeline_group=3 does not divide train.grad_accum=4; use a divisor of 4",),
    ),
    (
        ["devices=3", "mesh.pipeline=3", "model.layers=3", "train.micro_batch=1"]
        + ["train.grad_accum=3", "train.pipeline_group=1", "model.seq_len=64"],
        ("train.micro_batch*train.pipeline_group*model.seq_len = 1*1*64", "mesh.pipeline=3"),
    ),
    (
        ["devices=3", "mesh.pipeline=3", "model.layers=3", "train.micro_batch=1"],
        ("train.micro_batch*train.grad_accum*model.seq_len", "mesh.pipeline=3"),
    ),
    (
        ["train.grad_accum=4", "train.batch_parts=3"],
        ("train.batch_parts=3 does not divide train.grad_accum=4 micro-batches; use a divisor",),
    ),
    (
        ["train.batch_parts=0"],
        ("train.batch_parts=0 must be >= 1",),
    ),
    (
        ["train.grad_accum=4", "train.batch_parts=2", "model.name=bert", "model.vocab=264"],
        ("train.batch_parts=2 sums the parts' losses, but model.name=bert", "batch_parts=1"),
    ),
    (
        ["train.grad_accum=8", "train.batch_parts=2", "train.pipeline_group=3"],
        ("train.pipeline_group=3 does not divide train.grad_accum/train.batch_parts=4",),
    ),
    (
        ["devices=3", "mesh.pipeline=3", "model.layers=3", "train.micro_batch=1"]
        + ["train.grad_accum=6", "train.batch_parts=3", "model.seq_len=64"],
        ("train.micro_batch*train.grad_accum/train.batch_parts*model.seq_len = 1*2*64",),
    ),
    (
        ["train.micro_batch=100000000"],
        (
            "train.micro_batch=100000000 makes train.global_batch*(model.seq_len+1) = "
            "800000000*65 = 52,000,000,000 tokens a step, more than an int32 count holds",
            "reduce train.micro_batch",
        ),
    ),
    (  # the step's loss divides by all its tokens, however many parts feed them
        ["train.micro_batch=5000000", "train.grad_accum=4", "train.batch_parts=4"],
        ("train.micro_batch=5000000 makes", "= 10,400,000,000 tokens a step", "int32"),
    ),
    # data
    (["data.name=text-files"], ("data.name=text-files needs data.path=DIR",)),
    (["data.name=text-files", "data.path="], ("data.name=text-files needs data.path=DIR",)),
    (["data.path=/tmp"], ("data.path='/tmp' is only used by data.name=text-files",)),
    (
        ["model.vocab=128"],
        ("model.vocab=128 is smaller than 256 byte values of data.name=stdlib-code; use",),
    ),
    (
        ["model.vocab=128", "data.name=synthetic"],
        ("model.vocab=128 is smaller than 256 byte values of data.name=synthetic",),
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_OVERRIDES, ids=lambda x: str(x)[:60])
def test_bad_overrides(overrides, expected):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    _check_message(exc, expected)


BAD_FILES = [
    ("model: [1, 2\n", ("config file", "does not parse:")),
    ("- a\n- b\n", ("top level must be a mapping",)),
    ("model: 3\n", ("config section 'model' must be a mapping",)),
    ("model:\n  layer: 4\n", ("unknown config key 'model.layer'; did you mean 'model.layers'?",)),
    ("modle:\n  layers: 4\n", ("unknown config key 'modle'; did you mean 'model'?",)),
    ("train:\n  steps: many\n", ("train.steps='many' must be an integer",)),
    ("train:\n  logdir: 5\n", ("train.logdir=5 must be a string",)),
    # a key given twice (the last would silently win)
    ("devices: 8\ndevices: 4\n", ("bad.yaml': key 'devices' is given twice (lines 1 and 2)",)),
    ("train: {steps: 5}\ntrain: {steps: 7}\n", ("key 'train' is given twice (lines 1 and 2)",)),
    ("train:\n  steps: 5\n  log_every: 1\n  steps: 7\n", ("key 'train.steps' is given twice",)),
    ("model: {layers: 4, layers: 2}\n", ("key 'model.layers' is given twice (line 1); keep",)),
    ("memory:\n  offload: [{a: 1, a: 2}]\n", ("key 'memory.offload[0].a' is given twice",)),
]


@pytest.mark.parametrize(("text", "expected"), BAD_FILES, ids=lambda x: str(x)[:30])
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    _check_message(exc, expected)


def test_valid_splits_seeds_and_repeated_names_in_different_mappings_load(tmp_path):
    eff = ["model.name=efficientnet", "data.name=digits", "mesh.pipeline=3", "devices=6"]
    cfg = load_config(None, [*eff, "model.pipeline_splits=[1a,7a]"])
    assert cfg.model.pipeline_splits == ("1a", "7a")
    for seed in (0, 2**32 - 1):
        assert load_config(None, [f"train.seed={seed}"]).train.seed == seed
    path = tmp_path / "names.yaml"  # `name` in three sections is not a duplicate
    path.write_text("model: {name: gpt}\noptim: {name: sgd}\ndata: {name: synthetic}\n")
    assert load_config(path).optim.name == "sgd"


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "nope.yaml")
    _check_message(exc, ("nope.yaml", "does not exist"))


def test_empty_file_and_empty_section_are_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config(path) == load_config(None)
    path.write_text("model:\n")
    assert load_config(path) == load_config(None)


def test_config_from_dict_rejects_bad_input():
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        config_from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        config_from_dict({"train": {"step": 3}})


def test_list_fields_and_sizes():
    cfg = load_config(
        None,
        [
            "train.profile_steps=[3, 5]",
            "memory.device_budget=900MB",
            "model.name=efficientnet",
            "data.name=digits",
            "mesh.pipeline=2",
            "model.pipeline_splits=[4a]",
        ],
    )
    assert cfg.train.profile_steps == (3, 5)
    assert load_config(None, ["memory.offload=optimizer"]).memory.offload == ("optimizer",)
    assert cfg.model.pipeline_splits == ("4a",)
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg
    assert [parse_bytes(t) for t in ("900MB", "16GiB", "1234", "1.5 GB")] == [
        900_000_000,
        16 * 2**30,
        1234,
        1_500_000_000,
    ]
    assert load_config(None, ["memory.device_budget=1000"]).memory.device_budget == "1000"


def test_float16_without_loss_scale_warns():
    cfg = load_config(None, ["precision.params=float16"])
    assert any("precision.loss_scale=dynamic" in w for w in cfg.warnings())
    cfg = load_config(None, ["precision.params=float16", "precision.loss_scale=dynamic"])
    assert cfg.warnings() == []


def test_offloaded_activations_warn_where_the_planner_keeps_them_on_the_device():
    """The offload is real in the TPU/GPU program only (tests/planner/test_transfers.py), and
    the planner credits it on the TPU profiles (tests/planner/test_activation_offload.py;
    the stepwise schedules' backward tick in host memory and on the device)."""
    (warning,) = load_config(None, ["memory.offload=[activations]"]).warnings()
    assert warning.startswith("memory.offload includes activations")
    assert "TPU profiles without a pipeline or under gpipe and circular (under" in warning
    assert "stepwise schedules one backward tick's, on the device as well), else on" in warning
    assert load_config(None, ["memory.offload=[optimizer]"]).warnings() == []


def test_import_does_not_load_jax():
    code = (
        "import sys, jaxpod.config.load\n"
        "bad = [m for m in ('jax', 'jaxlib', 'flax', 'optax', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- the schema's Literal choices ---------------------------------------------------------

# What a choice needs besides itself to make a valid config.
COMPANIONS = {
    ("model.name", "gpt"): [],
    ("model.name", "bert"): ["model.vocab=264"],
    ("model.name", "efficientnet"): ["data.name=digits"],
    ("data.name", "text-files"): ["data.path=/some/dir"],
    ("data.name", "digits"): ["model.name=efficientnet"],
    ("data.name", "synthetic-imagenet"): ["model.name=efficientnet"],
    ("data.name", "image-folder"): ["model.name=efficientnet", "data.path=/some/dir"],
    ("memory.stream", "matrix"): ["model.remat=full"],
    ("train.pipeline_schedule", "circular"): [
        "mesh.pipeline=2",
        "train.grad_accum=2",
        "train.virtual_stages=2",
    ],
    ("train.pipeline_schedule", "1f1b"): ["mesh.pipeline=2"],
    ("train.pipeline_schedule", "zb-h1"): ["mesh.pipeline=2"],
    ("train.pipeline_schedule", "interleaved-1f1b"): [
        "mesh.pipeline=2",
        "train.virtual_stages=2",
        "train.grad_accum=2",
    ],
    ("train.pipeline_schedule", "zb-v"): ["mesh.pipeline=2", "train.virtual_stages=2"],
}


def _literal_fields(of_items: bool) -> dict[str, tuple[str, ...]]:
    """Dotted key -> Literal args, read off the dataclass annotations independently."""
    out = {}
    for section, cls in SECTIONS.items():
        for name, tp in typing.get_type_hints(cls).items():
            if of_items and typing.get_origin(tp) is tuple:
                tp = typing.get_args(tp)[0]
            elif of_items:
                continue
            if typing.get_origin(tp) is typing.Literal:
                out[f"{section}.{name}"] = typing.get_args(tp)
    return out


def test_choices_are_the_schema_literals():
    assert CHOICES == _literal_fields(of_items=False)
    assert (
        LIST_CHOICES
        == _literal_fields(of_items=True)
        == {"memory.offload": ("optimizer", "params", "activations")}
    )
    assert set(CHOICES["model.name"]) == set(KINDS)
    assert CHOICES["data.name"] == TEXT_DATA + IMAGE_DATA
    assert CHOICES["precision.params"] == CHOICES["precision.compute"] == DTYPES


@pytest.mark.parametrize(
    ("key", "option"),
    [(k, o) for k, options in CHOICES.items() for o in options],
    ids=lambda x: str(x),
)
def test_every_choice_is_accepted(key, option):
    cfg = load_config(None, [f"{key}={option}", *COMPANIONS.get((key, option), [])])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == option


@pytest.mark.parametrize("item", LIST_CHOICES["memory.offload"])
def test_every_list_choice_is_accepted(item):
    assert load_config(None, [f"memory.offload=[{item}]"]).memory.offload == (item,)


def test_config_properties_ask_the_model_kind():
    properties = {n for n, v in vars(Config).items() if isinstance(v, property)}
    assert properties == {
        "devices_per_process",
        "total_devices",
        "global_batch",
        "part_micro",
        "part_batch",
        "pipeline_group",
        "pipeline_passes",
        "tokens_per_step",
        "kind",
    }  # no name-based shortcuts: code asks cfg.kind what the model is
    kinds = {
        n: load_config(None, [f"model.name={n}", *COMPANIONS[("model.name", n)]]) for n in KINDS
    }
    assert kinds["efficientnet"].kind.data == "images"
    assert kinds["gpt"].kind.stages == "stacked" and kinds["bert"].kind.tensor_parallel


# --- devices per process, processes, total_devices -----------------------------------------


def test_processes_multiply_the_devices():
    one = load_config(TINY)
    assert (one.processes, one.devices_per_process, one.total_devices) == (1, 8, 8)
    two = load_config(TINY, ["devices=4"], processes=2)
    assert (two.processes, two.devices, two.devices_per_process, two.total_devices) == (2, 4, 4, 8)
    assert two.mesh.shape == (2, 2, 2)
    filled = load_config(None, ["devices=4", "mesh.pipeline=2"], processes=3)
    assert filled.mesh.shape == (6, 2, 1) and filled.global_batch == 4 * 6
    assert with_overrides(two, ["train.steps=3"]).processes == 2
    assert config_from_dict(config_to_dict(two), processes=2) == two


def test_processes_is_not_dumped_and_the_dump_loads_back(tmp_path):
    cfg = load_config(TINY, ["devices=4"], processes=2)
    assert "processes" not in config_to_dict(cfg)
    assert "processes" not in dump_yaml(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path, processes=2) == cfg
    with pytest.raises(ConfigError, match="= 8 does not match devices=4; set mesh.replica"):
        load_config(path)  # one process has half the devices of the dumped (resolved) mesh


MULTI_PROCESS_ERRORS = [
    (
        ["devices=4"],
        3,
        "mesh replica*pipeline*tensor = 2*2*2 = 8 does not match devices=4 per process x 3 "
        "processes = 12 devices; set mesh.replica=-1 to fill, or change devices",
    ),
    (
        ["devices=2", "mesh.replica=-1", "mesh.pipeline=3", "model.layers=3", "mesh.tensor=1"],
        2,
        "mesh.pipeline*mesh.tensor=3 does not divide devices=2 per process x 2 processes = 4 "
        "devices; change mesh.pipeline/mesh.tensor or devices",
    ),
    (
        ["devices=200", "mesh.replica=-1"],
        2,
        "devices=200 per process x 2 processes = 400 devices must be between 1 and 256",
    ),
    (["devices=4"], 0, "processes=0 must be >= 1"),
]


@pytest.mark.parametrize(("overrides", "processes", "expected"), MULTI_PROCESS_ERRORS)
def test_multi_process_mesh_messages_name_both_numbers(overrides, processes, expected):
    with pytest.raises(ConfigError) as exc:
        load_config(TINY, overrides, processes=processes)
    _check_message(exc, (expected,))


def test_processes_is_not_a_yaml_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("devices: 4\nprocesses: 2\n")
    for load in (
        lambda: load_config(path),
        lambda: load_config(None, ["processes=2"]),
        lambda: config_from_dict({"processes": 2}),
        lambda: with_overrides(load_config(None), {"processes": 2}),
    ):
        with pytest.raises(ConfigError) as exc:
            load()
        _check_message(exc, ("unknown config key 'processes'", "--num-processes"))


# --- the one loader: peek, and the CLI's early readers -------------------------------------

LOADER_CASES = [
    ("", []),
    ("devices: 4\nmesh: {pipeline: 2}\ntrain: {logdir: runs/yaml}\n", []),
    ("devices: 4\ntrain: {logdir: runs/yaml}\n", ["devices=2", "train.logdir=runs/cli"]),
    ("devices: 4\n", ["devices=8", "devices=2"]),  # the last override wins
    ("train:\n  logdir: '2024'\n", []),
    ("", ["train.logdir=2024"]),  # a number-like string override keeps its text
    ("", ['train.logdir="runs/quoted dir"']),
]


@pytest.mark.parametrize(("text", "overrides"), LOADER_CASES, ids=lambda x: str(x)[:40])
def test_early_readers_agree_with_load_config(tmp_path, text, overrides):
    from jaxpod.run.distributed import per_process_devices
    from jaxpod.run.profiling import _configured_logdir

    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg = load_config(path, overrides)
    assert (
        per_process_devices(str(path), overrides) == cfg.devices == peek(path, overrides, "devices")
    )
    assert _configured_logdir(str(path), overrides) == cfg.train.logdir


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        (None, [], "does not exist"),
        ("devices: [1\n", [], "does not parse"),
        ("devices: 4\n", ["devics=2"], "did you mean 'devices'?"),
        ("devices: four\n", [], "devices='four' must be an integer"),
        ("memory: {vocab_slice: 2}\n", [], "did you mean 'memory.vocab_slices'?"),
        ("devices: 8\ndevices: 4\n", [], "key 'devices' is given twice (lines 1 and 2)"),
    ],
)
def test_early_readers_refuse_what_load_config_refuses(tmp_path, text, overrides, expected):
    from jaxpod.run.distributed import per_process_devices
    from jaxpod.run.profiling import _configured_logdir

    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    for read in (load_config, per_process_devices, _configured_logdir):
        with pytest.raises(ConfigError) as exc:
            read(str(path), overrides)
        _check_message(exc, (expected,))


def test_peek_defaults_and_no_raw_yaml_readers_elsewhere():
    assert peek(None, [], "train.logdir") == TrainConfig().logdir
    assert peek(TINY, [], "mesh.tensor") == 2
    assert peek(TINY, ["optim.lr=3e-4"], "optim.lr") == pytest.approx(3e-4)
    with pytest.raises(KeyError):
        peek(None, [], "processes")
    for module in ("run/distributed.py", "run/profiling.py"):
        assert "yaml" not in (ROOT / "jaxpod" / module).read_text(), module


# --- the package's layering ------------------------------------------------------------------


def _config_imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / "jaxpod" / "config" / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpod.config"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxpod.config")}
    return found


def test_layers_import_downwards_only():
    """tables (kinds, efficientnet_specs) <- schema <- fields <- rules_<topic> <- rules <- load
    (and safe_yaml, presets <- yaml_file <- load), with the divisibility table between fields
    and rules: kinds <- rule_sizes <- divisibility_<topic> <- divisibility (and fields) <-
    rules. Each imports only layers below."""
    topics = {p.stem for p in (ROOT / "jaxpod" / "config").glob("rules_*.py")}
    tables = {"jaxpod.config.kinds", "jaxpod.config.efficientnet_specs"}
    assert _config_imports("kinds") == _config_imports("efficientnet_specs") == set()
    assert _config_imports("schema") <= tables
    assert _config_imports("fields") <= {"jaxpod.config.schema", *tables}
    base = {"jaxpod.config.schema", "jaxpod.config.fields", *tables}
    for topic in topics:
        assert _config_imports(topic) <= base, topic
    assert _config_imports("rule_sizes") == {"jaxpod.config.kinds"}
    sized = {"jaxpod.config.rule_sizes", "jaxpod.config.schema"}
    parts = {p.stem for p in (ROOT / "jaxpod" / "config").glob("divisibility_*.py")}
    for part in parts:
        assert _config_imports(part) <= sized, part
    table = {"jaxpod.config.fields", *sized, *(f"jaxpod.config.{p}" for p in parts)}
    assert _config_imports("divisibility") <= table
    below = base | {f"jaxpod.config.{t}" for t in topics} | {"jaxpod.config.divisibility"}
    assert {"jaxpod.config.schema"} <= _config_imports("rules") <= below
    assert _config_imports("safe_yaml") == set()
    assert _config_imports("presets") == {"jaxpod.config.fields"}
    reader = {"jaxpod.config.fields", "jaxpod.config.safe_yaml", "jaxpod.config.presets"}
    assert _config_imports("yaml_file") == reader
    ends = {"jaxpod.config.rules", "jaxpod.config.yaml_file", *reader}
    assert _config_imports("load") <= {*ends, *below}
    assert "jaxpod.config.rules" in _config_imports("load")
    assert "TYPE_CHECKING" not in (ROOT / "jaxpod" / "config" / "rules.py").read_text()


@pytest.mark.parametrize("module", ["schema", "rules", "load"])
def test_each_module_imports_alone(module):
    code = (
        f"import sys, jaxpod.config.{module}\n"
        "bad = [m for m in ('jax', 'jaxlib', 'flax', 'optax', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
