"""`testbucket://`: an in-memory fsspec filesystem under its own protocol, standing in for an
object store (gs://, s3://) in the tests of URLs (no network).

A path treated as local would make a `testbucket:` folder where a test runs, or find nothing.
jax-free.
"""

from __future__ import annotations

from pathlib import Path

from fsspec.implementations.memory import MemoryFileSystem


class BucketFileSystem(MemoryFileSystem):
    """An in-memory store under its own protocol and its own (empty) contents."""

    protocol = "testbucket"
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("testbucket://"))


def open_bucket():
    """The store, registered and emptied: the fsspec filesystem of `testbucket://`."""
    import fsspec

    fsspec.register_implementation("testbucket", BucketFileSystem, clobber=True)
    BucketFileSystem.store.clear()
    BucketFileSystem.pseudo_dirs[:] = [""]
    BucketFileSystem.clear_instance_cache()
    return fsspec.filesystem("testbucket")


def upload(fs, local: Path, url: str) -> str:
    """Every file under the folder `local` copied to `url` (same relative paths); `url`."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.pipe_file(f"{url}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return url
