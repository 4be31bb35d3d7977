"""`jaxpod train` on an image folder it cannot read: exit 2 and one line naming the fault."""

import pytest
from helpers import CONFIGS
from PIL import Image

from jaxpod import cli

SMALL = (  # the digits recipe at a quarter width on 3 block groups: a quick init
    "model.width_mult=0.25",
    "model.depth_mult=0.2",
    "model.block_groups=3",
    "model.pipeline_splits=[3a]",
    "model.num_classes=2",
)


def _train_error(folder, tmp_path, capsys) -> str:
    argv = [
        "train",
        str(CONFIGS / "efficientnet_digits.yaml"),
        *SMALL,
        "data.name=image-folder",
        f"data.path={folder}",
        f"train.logdir={tmp_path / 'run'}",
    ]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # after the start-up phases' lines
    assert line.startswith("jaxpod: error: ") and "Traceback" not in err
    assert err.count("jaxpod: error:") == 1
    return line


def test_empty_folder_is_one_line(tmp_path, capsys, in_process_cli):
    (tmp_path / "empty").mkdir()
    line = _train_error(tmp_path / "empty", tmp_path, capsys)
    assert f"data.path={str(tmp_path / 'empty')!r} has no class subdirectories" in line


def test_a_file_that_is_no_image_is_named(tmp_path, capsys, in_process_cli):
    """Two classes; class b's two files are text named .jpg: step 0's batch (64 rows of 4
    training images) reads at least one of them, before the train step is compiled."""
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (20 + i, 30), (i, i, i)).save(root / "a" / f"{i}.png")
    (root / "b").mkdir()
    for name in ("x.jpg", "y.jpg"):
        (root / "b" / name).write_text("not a jpeg")
    line = _train_error(root, tmp_path, capsys)
    assert "cannot decode image 'b/x.jpg'" in line or "cannot decode image 'b/y.jpg'" in line
    assert line.endswith("fix or remove the file")
