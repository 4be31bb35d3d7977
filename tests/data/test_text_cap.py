"""The text loaders' byte cap (`max_bytes`) limits what is read, not only what is kept: a
text file far larger than the cap is read no further than the cap (plus one byte, to know it
was cut), and a character cut in two at the cap does not make the file "binary"."""

from __future__ import annotations

import builtins

from jaxpod.data import documents, text


def test_a_large_file_is_read_only_up_to_the_cap(tmp_path, monkeypatch):
    (tmp_path / "big.txt").write_text("abcdefgh\n" * 300_000)  # 2.7 MB
    reads = []

    def recording_open(*args, **kw):
        stream = builtins.open(*args, **kw)
        read = stream.read
        stream_read = lambda n=-1: reads.append(n) or read(n)  # noqa: E731
        return _Wrapped(stream, stream_read)

    monkeypatch.setattr(documents, "open", recording_open, raising=False)
    texts, skipped, cut = text._capped(
        documents.text_files(str(tmp_path)), 1000, documents.read_text
    )
    assert ([len(t) for t in texts], skipped, cut) == ([1000], 0, True)
    assert reads == [1001]


def test_a_character_cut_at_the_cap_is_still_text(tmp_path):
    (tmp_path / "accents.txt").write_text("é" * 1000)  # 2 bytes each
    texts, skipped, cut = text._capped(
        documents.text_files(str(tmp_path)), 1001, documents.read_text
    )
    assert ([len(t) for t in texts], skipped, cut) == ([1001], 0, True)


class _Wrapped:
    def __init__(self, stream, read):
        self._stream, self.read = stream, read

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()
