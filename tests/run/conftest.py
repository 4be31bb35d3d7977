"""Fixtures of the run tests that use an object store."""

from __future__ import annotations

import pytest


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """The in-memory `testbucket://` store (`helpers.bucket`), emptied; the caches and the
    working directory in `tmp_path`, so that anything written locally is found there."""
    from helpers.bucket import open_bucket

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    return open_bucket()
