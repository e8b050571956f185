"""One object of an object store (s3://, gs://, abfs://, through fsspec) read into a local file, for
rayllm.loader.model_sources: its byte ranges read in parallel and written at their offsets, each range read
again when the store fails it or sends it short, progress logged while it runs, and the result checked
against the listed size and the store's MD5 where the store keeps one. No torch.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rayllm.common.errors import describe

log = logging.getLogger("rayllm.loader")

CHUNK_BYTES = 32 << 20
WORKERS = 8
RANGE_TRIES = 4  # a range is read up to this many times (a store's transient 5xx, a reset connection)
RETRY_S = 1.0  # before the second try; doubled before each further one
PROGRESS_S = 10.0  # a download still running logs its bytes this often


class IncompleteDownload(OSError):
    """An object that came back shorter than listed, or failed its MD5 check."""


def store_md5(fs, info: dict) -> str | None:
    """The object's MD5 in hex where the store keeps one: Azure's Content-MD5 (set by single-shot uploads),
    GCS's base64 md5Hash (composite objects have none), an S3 ETag that is one (s3_etag_is_md5); else None,
    and only the size is checked."""
    azure_md5 = (info.get("content_settings") or {}).get("content_md5")
    if isinstance(azure_md5, (bytes, bytearray)) and len(azure_md5) == 16:
        return bytes(azure_md5).hex()
    if info.get("md5Hash"):
        try:
            raw = base64.b64decode(str(info["md5Hash"]), validate=True)
        except ValueError:
            return None
        return raw.hex() if len(raw) == 16 else None
    etag = str(info.get("ETag") or "").strip('"')
    if re.fullmatch(r"[0-9a-f]{32}", etag) and s3_etag_is_md5(fs, info["name"]):
        return etag
    return None


def s3_etag_is_md5(fs, name: str) -> bool:
    """Whether an S3 object's ETag is its MD5: only for an object stored unencrypted or with SSE-S3 (AES256),
    not with SSE-KMS or SSE-C, and not in an S3 Express directory bucket (`--x-s3`); a multipart upload's
    ETag (`<hex>-<parts>`) never is. A listing does not say how an object is encrypted; its HEAD does."""
    if not hasattr(fs, "call_s3"):  # an ETag from another backend: its meaning is unknown
        return False
    bucket, key, _ = fs.split_path(name)
    if bucket.endswith("--x-s3"):
        return False
    head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    return head.get("ServerSideEncryption") in (None, "AES256") and not head.get("SSECustomerAlgorithm")


class _Progress:
    """Bytes done of one object, logged at most every PROGRESS_S (its ranges finish on several threads)."""

    def __init__(self, name: str, size: int):
        self.name, self.size, self.done = name, size, 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now, done = time.monotonic(), self.done
            if now - self.last < PROGRESS_S or done == self.size:
                return
            self.last = now
        log.info("%s: %.0f of %.0f MB (%.0f MB/s)", self.name, done / 1e6, self.size / 1e6,
                 done / 1e6 / max(now - self.t0, 1e-3))


def _read_range(fs, name: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of the object, read again (after RETRY_S, then twice as long each time) when the
    store fails the read or sends fewer bytes."""
    error: Exception | None = None
    for attempt in range(RANGE_TRIES):
        if error is not None:
            log.warning("%s: bytes %d-%d: %s; reading them again", name, start, end, describe(error))
            time.sleep(RETRY_S * 2 ** (attempt - 1))
        try:
            data = fs.cat_file(name, start=start, end=end)
        except Exception as exc:  # the backend's own errors, not all of them OSErrors (botocore, azure-core)
            error = exc
            continue
        if len(data) == end - start:
            return data
        error = IncompleteDownload(f"{name}: bytes {start}-{end} came back with {len(data)} bytes")
    assert error is not None
    raise error


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """All of `data` at `offset`: os.pwrite may write less than it was given (a disk filling up, a signal)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # no progress and no error: stop rather than spin
            raise IncompleteDownload(f"pwrite wrote nothing at offset {offset}")
        view, offset = view[n:], offset + n


def download(fs, name: str, size: int, md5: str | None, dest: str) -> None:
    """The object `name` of `size` bytes into `dest`; IncompleteDownload when it is short or fails its MD5."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    progress = _Progress(name, size)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def chunk(start: int) -> None:
            data = _read_range(fs, name, start, min(start + CHUNK_BYTES, size))
            _write_all(fd, data, start)
            progress.add(len(data))

        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(chunk, range(0, size, CHUNK_BYTES)))
    finally:
        os.close(fd)
    if progress.done != size or os.path.getsize(dest) != size:
        raise IncompleteDownload(f"{name} came back with {progress.done} of {size} bytes")
    if md5 is not None:
        digest = hashlib.md5(usedforsecurity=False)
        with open(dest, "rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
        if digest.hexdigest() != md5:
            raise IncompleteDownload(f"{name} failed its MD5 check")
