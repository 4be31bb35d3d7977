"""The run record's writers (`jaxpod.run.metrics`): the HParams summary, read back by
TensorBoard's own event reader."""

from __future__ import annotations

from jaxpod.run.metrics import MetricsWriter, flat_hparams, hparams_event


def test_hparams_event_round_trips_through_tensorboard(tmp_path):
    """Written with tensorboard's protos (no TensorFlow), read back with its EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    hparams = flat_hparams(
        {"mesh": {"replica": 2}, "optim": {"lr": 3e-3, "name": "adamw"}, "model": {"tie": True}}
        | {"train": {"profile_steps": [2, 4], "grad_accum": None}}
    )
    assert hparams == {
        "mesh.replica": 2,
        "optim.lr": 3e-3,
        "optim.name": "adamw",
        "model.tie": True,
        "train.profile_steps": "[2, 4]",
    }
    assert hparams_event(hparams).summary.value[0].tag == metadata.SESSION_START_INFO_TAG
    with MetricsWriter(tmp_path) as writer:
        writer.hparams(hparams)
        writer.write({"step": 1, "loss": 2.5})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    info = metadata.parse_session_start_info_plugin_data(content)
    assert info.hparams["mesh.replica"].number_value == 2
    assert info.hparams["optim.name"].string_value == "adamw"
    assert info.hparams["model.tie"].bool_value is True
    assert acc.Scalars("train/loss")[0].value == 2.5
