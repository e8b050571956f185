"""rayllm.loader.object_store's reads on fsspec's own in-memory filesystem (the interface s3fs, gcsfs and
adlfs implement), made to fail as stores and disks do: a range refused or cut short, a short pwrite. The
reference is the object's own bytes."""

from __future__ import annotations

import collections
import hashlib
import os

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from rayllm.loader import object_store

MIB = 1 << 20


class FlakyStore(MemoryFileSystem):
    """Refuses the first read of every range (a reset connection) and sends the second one short."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: collections.Counter[int] = collections.Counter()

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.reads[start] += 1
        if self.reads[start] == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        data = super().cat_file(path, start=start, end=end, **kwargs)
        return data[:-1] if self.reads[start] == 2 else data


@pytest.fixture
def small_ranges(monkeypatch):
    monkeypatch.setattr(object_store, "CHUNK_BYTES", MIB)
    monkeypatch.setattr(object_store, "RETRY_S", 0.0)


def _store(fs: MemoryFileSystem, name: str, size: int) -> bytes:
    body = os.urandom(size)
    fs.pipe_file(name, body)
    return body


def test_each_range_is_read_again_until_it_comes_whole_and_progress_is_logged(small_ranges, monkeypatch, tmp_path,
                                                                             caplog):
    monkeypatch.setattr(object_store, "PROGRESS_S", 0.0)
    fs = FlakyStore(skip_instance_cache=True)
    body = _store(fs, "/flaky/blob.gguf", 5 * MIB + 123)
    dest = tmp_path / "blob.gguf"
    with caplog.at_level("INFO", logger="rayllm.loader"):
        object_store.download(fs, "/flaky/blob.gguf", len(body), hashlib.md5(body).hexdigest(), str(dest))
    assert dest.read_bytes() == body
    assert sorted(fs.reads) == list(range(0, len(body), MIB)) and set(fs.reads.values()) == {3}
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reading them again" in m for m in messages) == 12  # each range: refused, then short
    assert sum(m.startswith("/flaky/blob.gguf: ") and " of 5 MB (" in m for m in messages) == 5  # all but the last


def test_a_range_the_store_keeps_refusing_fails_the_download(small_ranges, tmp_path):
    class Down(MemoryFileSystem):
        def cat_file(self, path, start=None, end=None, **kwargs):
            raise TimeoutError("read timed out")

    fs = Down(skip_instance_cache=True)
    body = _store(fs, "/down/blob.gguf", 2 * MIB)
    with pytest.raises(TimeoutError, match="read timed out"):
        object_store.download(fs, "/down/blob.gguf", len(body), None, str(tmp_path / "blob.gguf"))


def test_a_short_write_is_written_to_the_end(small_ranges, monkeypatch, tmp_path):
    """os.pwrite may write less than it is given (a disk filling up, a signal); the file was then ftruncated
    to its size, so the size check passed over a hole of zeros. Without an MD5 to catch it, only writing the
    rest does."""
    fs = MemoryFileSystem(skip_instance_cache=True)
    body = _store(fs, "/short/blob.gguf", 3 * MIB + 7)
    real = os.pwrite

    def a_third(fd: int, data, offset: int) -> int:  # the kernel takes a third of what it is given
        return real(fd, bytes(data[: max(1, len(data) // 3)]), offset)

    monkeypatch.setattr(object_store.os, "pwrite", a_third)
    dest = tmp_path / "blob.gguf"
    object_store.download(fs, "/short/blob.gguf", len(body), None, str(dest))
    assert dest.read_bytes() == body


def test_an_md5_mismatch_fails_the_download(tmp_path):
    fs = MemoryFileSystem(skip_instance_cache=True)
    body = _store(fs, "/md5/blob.gguf", 1000)
    with pytest.raises(object_store.IncompleteDownload, match="failed its MD5 check"):
        object_store.download(fs, "/md5/blob.gguf", len(body), hashlib.md5(b"other").hexdigest(), str(tmp_path / "b"))
