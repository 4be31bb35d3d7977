"""A key given twice on the command line is refused in one line naming it, exit 2, by every
command that reads overrides (the last would otherwise win silently, as a YAML duplicate
would, which the loader refuses); the library's own override lists still replace a key."""

from __future__ import annotations

import pytest
from helpers import TINY_YAML

from jaxpod import cli
from jaxpod.config import load_config

TARGET = ["--target", "h100-80gb:8"]
COMMANDS = {
    "train": [],
    "profile": [],
    "plan": [],
    "compile": [],
    "estimate": TARGET,
    "search": TARGET,
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_key_given_twice_is_one_line_naming_it(command, tmp_path, capsys, in_process_cli):
    argv = [command, str(TINY_YAML), "train.steps=3", "mesh.tensor=1", " train.steps =5"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, *COMMANDS[command], f"train.logdir={tmp_path / 'run'}"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "jaxpod: error: key 'train.steps' is given twice on the command line ('train.steps=3' "
        "and ' train.steps =5'); keep one"
    )
    assert not (tmp_path / "run").exists()


def test_the_librarys_own_lists_still_replace_a_key():
    assert load_config(TINY_YAML, ["train.steps=3", "train.steps=5"]).train.steps == 5
