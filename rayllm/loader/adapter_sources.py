"""LoRA adapter sources (a Hugging Face id, an object-store URI) fetched into this node's cache, as
rayllm.loader.model_sources fetches models, but only the adapter's named top-level files, each refused
before anything is downloaded when it is missing or larger than its limit: a client names the source (a
request's `lora_path`), so any repository or prefix under the operator's roots may be named, a whole model's
among them. The copies live in the cache's `adapters/` folder, where those beyond the most recently used
few are removed (`prune_adapters`) unless a loader holds them (`hold_adapter`). No torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import re
import shutil

from rayllm.loader.model_sources import (
    HF_ID,
    MANIFEST,
    Fetched,
    ModelSourceError,
    _cached,
    _complete,
    _entry_dir,
    _hf_listing,
    _listing,
    _local,
    _source_error,
    _store_get,
    cache_root,
    uri_scheme,
)

log = logging.getLogger("rayllm.loader")

ADAPTERS = "adapters"  # the cache's folder of adapter copies


class NotAnAdapter(ModelSourceError):
    """An adapter source that is there but is no adapter this server takes: a file missing at its top level,
    or larger than its limit. Found from the listing, before anything is downloaded."""


def fetch_adapter(source: str, limits: dict[str, int], keep: int) -> Fetched:
    """A LoRA adapter in this node's cache: only the top-level files `limits` names ({file: its largest size
    in bytes}), NotAnAdapter (before anything is downloaded) when one is missing or larger. A Hugging Face
    id's copy is that of the commit its revision names now; offline, the node's Hugging Face snapshot as it
    is. After a download, the node's adapter copies beyond the `keep` most recently used are removed."""
    m = None if uri_scheme(source) else HF_ID.match(source)
    try:
        if uri_scheme(source):
            fetched = _adapter_from_store(source, limits)
        elif m is None:
            raise ModelSourceError(f"adapter source {source!r} is not a Hugging Face id or an object-store URI")
        else:
            fetched = _adapter_from_hub(source, m, limits)
    except ModelSourceError:
        raise
    except Exception as exc:  # every backend's own errors, as _fetch's
        raise _source_error(source, m["rev"] if m else None, exc) from None
    if fetched.downloaded:
        prune_adapters(keep)
    return fetched


def _check_adapter(source: str, sizes: dict[str, int | None], limits: dict[str, int]) -> None:
    for name, limit in limits.items():
        if name not in sizes:
            raise NotAnAdapter(f"adapter source {source!r}: no {name} at its top level")
        size = sizes[name]
        if size is None or size > limit:  # None: the hub did not say
            raise NotAnAdapter(f"adapter source {source!r}: {name} holds {size} bytes, more than the "
                               f"{limit} an adapter for this server can")


def _adapter_from_store(uri: str, limits: dict[str, int]) -> Fetched:
    import fsspec

    entry = _entry_dir(uri, ADAPTERS)
    if _complete(entry):
        return Fetched(_local(entry), False)
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)
    listing = _listing(fs, root.rstrip("/"), False)
    _check_adapter(uri, {n: int(i["size"]) for n, i in listing.items()}, limits)
    return _cached(uri, entry, {n: listing[n] for n in limits}, ".", _store_get(fs))


def _adapter_from_hub(source: str, m: re.Match, limits: dict[str, int]) -> Fetched:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    sha, names, cached = _hf_listing(m["repo"], m["rev"])
    if m["file"]:
        raise NotAnAdapter(f"adapter source {source!r} names a file, not a repository")
    top = [n for n in limits if n in names]
    if cached is not None:  # no hub: the snapshot this node holds, read where it is (nothing to download)
        _check_adapter(source, {n: os.path.getsize(os.path.join(cached, n)) for n in top}, limits)
        return Fetched(cached, False)
    entry = _entry_dir(f"hf://{sha}", ADAPTERS)  # a commit's files are the same whatever the repo's spelling
    if _complete(entry):
        return Fetched(_local(entry), False)
    sizes = {n: get_hf_file_metadata(hf_hub_url(m["repo"], n, revision=sha)).size for n in top}
    _check_adapter(source, sizes, limits)

    def get(rel: str, info: dict, dest: str) -> None:
        hf_hub_download(m["repo"], rel, revision=sha, local_dir=os.path.dirname(dest))

    return _cached(source, entry, {n: {"size": sizes[n]} for n in limits}, ".", get)


def hold_adapter(path: str) -> contextlib.AbstractContextManager | None:
    """A hold on an adapter copy from fetch_adapter, which prune_adapters (in any process of the node) leaves
    alone while the hold is open; None when the copy was removed meanwhile (fetch it again). Also the copy's
    use, for prune_adapters's order. A snapshot in the Hugging Face cache is never removed: nothing to hold."""
    if os.path.normpath(os.path.dirname(path)) != os.path.normpath(os.path.join(cache_root(), ADAPTERS)):
        return contextlib.nullcontext()
    manifest = os.path.join(path, MANIFEST)
    try:
        held = open(manifest, "rb")
    except FileNotFoundError:
        return None
    fcntl.flock(held, fcntl.LOCK_SH)
    try:  # still the copy's manifest: not removed (and fetched again) before the lock was taken
        current = os.fstat(held.fileno()).st_ino == os.stat(manifest).st_ino and _complete(path)
        if current:
            os.utime(manifest)
    except FileNotFoundError:
        current = False
    if not current:
        held.close()
        return None
    return held


def prune_adapters(keep: int) -> None:
    """The node's adapter copies beyond the `keep` most recently used removed, but for those held."""

    def used(manifest: str) -> float:
        try:
            return os.path.getmtime(manifest)
        except OSError:  # removed meanwhile
            return 0.0

    manifests = glob.glob(os.path.join(glob.escape(os.path.join(cache_root(), ADAPTERS)), "*", MANIFEST))
    for manifest in sorted(manifests, key=used, reverse=True)[keep:]:
        try:
            with open(manifest, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while a loader holds the copy
                shutil.rmtree(os.path.dirname(manifest))
            log.info("adapter copy %s removed (least recently used)", os.path.dirname(manifest))
        except OSError:  # held, or removed by another process meanwhile
            continue
