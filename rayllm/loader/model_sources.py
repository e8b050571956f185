"""Model and adapter sources other than a local path: a Hugging Face id, or an object-store URI (s3://,
gs://, abfs://) read through fsspec. Each is downloaded once per node into a local cache and then used as a
local path. No torch.

What a source is, and so what is fetched, is decided from its file list before anything is downloaded
(`select`): config.json (or a PEFT adapter's adapter_config.json) beside safetensors makes a model directory,
of which only the top-level config, tokenizer and chat-template files and the safetensors its
model.safetensors.index.json names are fetched (no subfolder, no `consolidated*.safetensors`, no GGUF);
else a source holding exactly one GGUF is that GGUF, and one holding several must name one. A part may be
fetched alone (PARTS): a tokenizer replica fetches no weights, and the app build only checks the source
(`check`), which also pins a Hugging Face id to the commit its revision names at that moment.

Hugging Face ids (`org/name`, `org/name@revision`, `org/name/file.gguf` for one GGUF of a repo) go through
huggingface_hub, which keeps its own cache and honours HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE; offline
or with the hub unreachable, the snapshot this node's cache holds is used.

Object-store URIs go to RAYLLM_MODEL_CACHE (default ~/.cache/rayllm/models): the files are read into
`<entry>.partial` (rayllm.loader.object_store: parallel ranges, checked), and the directory is renamed into
place only when complete, so a crashed download never looks complete and is redone. A file lock makes
replicas on one node download once; the others wait and use the result.

LoRA adapters are fetched by rayllm.loader.adapter_sources (their own files only, into the same cache).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rayllm.common.errors import describe
from rayllm.loader.object_store import download, store_md5

log = logging.getLogger("rayllm.loader")

URI_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "az")
INDEX = "model.safetensors.index.json"
# A model directory's files beside its weights: config, tokenizer, chat template, the index of the shards.
META = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
        "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
        "chat_template.json", "adapter_config.json", INDEX)
# Weights in another layout beside the Hugging Face ones (Mistral's own names): never fetched.
IGNORED = ("consolidated*.safetensors",)
# The parts of a source fetched alone: all a model needs; what its tokenizer needs (the META files, or the
# GGUF); for the app build's check, the META files and a GGUF only looked up.
PARTS = ("model", "tokenizer", "check")
HF_ID = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<file>/[^@]+\.(?i:gguf))?"
                   r"(?:@(?P<rev>[\w./-]+))?$")
MANIFEST = ".rayllm-manifest.json"


class ModelSourceError(FileNotFoundError):
    """A model or adapter source that cannot be fetched; the message names the source."""


def is_gguf(path: str) -> bool:
    """A GGUF file, by its name (`.gguf` in any case)."""
    return path.lower().endswith(".gguf")


def uri_scheme(source: str) -> str | None:
    scheme = source.split("://", 1)[0].lower() if "://" in source else None
    return scheme if scheme in URI_SCHEMES else None


def is_remote(source: str | None) -> bool:
    """A Hugging Face id or an object-store URI (not an existing local path)."""
    if not source:
        return False
    if uri_scheme(source):
        return True
    return not os.path.exists(os.path.expanduser(source)) and HF_ID.match(source) is not None


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("RAYLLM_MODEL_CACHE") or os.path.join(base, "rayllm", "models")


@dataclass(frozen=True)
class Fetched:
    path: str  # local file (a GGUF) or directory
    downloaded: bool  # False: it was already in this node's cache


@dataclass(frozen=True)
class Selection:
    """What a source's file list makes it: a model directory (its META files, its safetensors) or one GGUF."""

    meta: tuple[str, ...]
    weights: tuple[str, ...]  # the top-level safetensors (the index narrows them), or the GGUF
    gguf: bool

    def files(self, part: str, index: dict | None = None) -> tuple[str, ...]:
        """The files `part` fetches; `index`: the parsed INDEX, read when the weights are wanted."""
        if self.gguf:
            return () if part == "check" else self.weights
        if part != "model":
            return self.meta
        if INDEX not in self.meta:
            return self.meta + self.weights
        named = sorted(set((index or {}).get("weight_map", {}).values()))
        unknown = [n for n in named if n not in self.weights]
        if not named or unknown:
            raise ValueError(f"{INDEX} names {', '.join(unknown) or 'no weights'}, not the source's safetensors")
        return self.meta + tuple(named)


def select(source: str, names: Iterable[str]) -> Selection:
    """The Selection of a source whose files (relative paths) are `names`; only top-level files count."""
    top = {n for n in names if "/" not in n}
    tensors = tuple(sorted(n for n in top if n.endswith(".safetensors")
                           and not any(fnmatch.fnmatch(n, p) for p in IGNORED)))
    if tensors and top & {"config.json", "adapter_config.json"}:
        return Selection(tuple(sorted(top.intersection(META))), tensors, False)
    ggufs = sorted(n for n in top if is_gguf(n))
    if len(ggufs) == 1:
        return Selection((), (ggufs[0],), True)
    if ggufs:
        raise ModelSourceError(f"model source {source!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
                               "name one as <source>/<file>.gguf")
    raise ModelSourceError(f"model source {source!r}: no config.json with safetensors weights, and no GGUF file")


def fetch(source: str, revision: str | None = None, part: str = "model") -> Fetched:
    """The local copy of `source` (PARTS: all of it, or what its tokenizer needs), downloaded first where
    this node lacks it. Every failure is a ModelSourceError naming the source."""
    if part not in PARTS[:2]:  # a check is check()'s
        raise ValueError(f"part must be one of {PARTS[:2]}, not {part!r}")
    fetched, _ = _fetch(source, revision, part)
    assert fetched is not None  # only a check leaves a GGUF unfetched
    return fetched


def check(source: str, revision: str | None = None) -> str:
    """For the app build: that `source` is there and readable, fetching no weights (its config and tokenizer
    files, or a GGUF's metadata only). Returns the source as every deployment should fetch it: a Hugging Face
    id pinned to the commit its revision names now (`org/name@<sha>`), an object-store URI as it is."""
    return _fetch(source, revision, "check")[1]


def _fetch(source: str, revision: str | None, part: str) -> tuple[Fetched | None, str]:
    m = None if uri_scheme(source) else HF_ID.match(source)
    try:
        if uri_scheme(source):
            return fetch_uri(source, part), source
        if m is None:
            raise ModelSourceError(f"model source {source!r} is not a local path, a Hugging Face id or an "
                                   f"{'/'.join(s + '://' for s in URI_SCHEMES[:3])} URI")
        filename = (m["file"] or "").lstrip("/") or None
        path, sha = fetch_hf(source, m["repo"], filename, m["rev"] or revision, part)
        return (None if path is None else Fetched(path, True)), f"{m['repo']}{'/' + filename if filename else ''}@{sha}"
    except ModelSourceError:
        raise
    except Exception as exc:  # every backend's own errors (not all OSErrors): a client's lora_path is a 4xx
        raise _source_error(source, (m["rev"] if m else None) or revision, exc) from None


def _source_error(source: str, revision: str | None, exc: Exception) -> ModelSourceError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return ModelSourceError(f"model source {source!r}: gated on Hugging Face; accept its terms and set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelSourceError(f"model source {source!r}: no such Hugging Face repository, or it is private "
                                "and HF_TOKEN does not grant access")
    if isinstance(exc, RevisionNotFoundError):
        return ModelSourceError(f"model source {source!r}: revision {revision!r} not found")
    if isinstance(exc, LocalEntryNotFoundError):
        return ModelSourceError(f"model source {source!r}: not in the Hugging Face cache and the hub is not "
                                "reachable (HF_HUB_OFFLINE, or no network)")
    if isinstance(exc, HfHubHTTPError):
        return ModelSourceError(f"model source {source!r}: Hugging Face answered {describe(exc)}")
    if isinstance(exc, ImportError):  # fsspec names the backend package it needs
        return ModelSourceError(f"model source {source!r}: its filesystem is not installed (pip install "
                                f"'rayllm-tp[storage]': s3fs, gcsfs, adlfs): {describe(exc)}")
    log.debug("model source %s failed", source, exc_info=exc)
    return ModelSourceError(f"model source {source!r}: {describe(exc)}")


def fetch_hf(source: str, repo: str, filename: str | None, revision: str | None, part: str) -> tuple[str | None, str]:
    """(The local snapshot folder or GGUF, None for a GGUF's check; the commit they are of)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, snapshot_download

    t0 = time.monotonic()
    sha, names, cached = _hf_listing(repo, revision)
    where = " in this node's Hugging Face cache (HF_HUB_OFFLINE, or the hub unreachable)" if cached else ""
    if filename and filename not in names:
        raise ModelSourceError(f"model source {source!r}: no file {filename!r}{where}")
    try:
        sel = Selection((), (filename,), True) if filename else select(source, names)
    except ModelSourceError as exc:
        raise ModelSourceError(f"{exc}{where}") from None
    if sel.gguf and part == "check":
        if cached is None:  # a gated or private file fails here, before any replica starts
            get_hf_file_metadata(hf_hub_url(repo, sel.weights[0], revision=sha))
        return None, sha

    def read_index(path: str) -> dict | None:
        if part != "model" or INDEX not in sel.meta:
            return None
        with open(os.path.join(path, INDEX)) as f:
            return json.load(f)

    if cached is not None:
        path = cached
    else:
        # The revision as given (huggingface_hub records the commit a branch names, for an offline start), the
        # weights then from the commit that came, as named by the index read from it.
        first = sel.weights if sel.gguf else sel.meta
        path = snapshot_download(repo, revision=revision, allow_patterns=[glob.escape(f) for f in first])
        sha = os.path.basename(path)
    try:
        wanted = sel.files(part, read_index(path))
    except ValueError as exc:
        raise ModelSourceError(f"model source {source!r}: {exc}") from None
    if cached is None and part == "model" and not sel.gguf:
        weights = [glob.escape(f) for f in wanted if f not in sel.meta]
        snapshot_download(repo, revision=sha, allow_patterns=weights)
    missing = [f for f in wanted if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ModelSourceError(f"model source {source!r}: {', '.join(missing)} missing from commit {sha}{where}")
    local = os.path.join(path, sel.weights[0]) if sel.gguf else path
    log.info("model source %s: %s (%.2f s)", source, local, time.monotonic() - t0)
    return local, sha


def _hf_listing(repo: str, revision: str | None) -> tuple[str, list[str], str | None]:
    """(The commit `revision` names, its files, None); offline or with the hub unreachable or failing,
    as huggingface_hub itself does, the snapshot this node's cache holds: (its commit, its files, its folder)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(repo, revision=revision)
        return str(info.sha), [s.rfilename for s in info.siblings or ()], None
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError):
        raise
    except HfHubHTTPError as exc:
        if getattr(exc.response, "status_code", 500) < 500:
            raise
        reason = describe(exc)
    except Exception as exc:  # HF_HUB_OFFLINE (OfflineModeIsEnabled), or the transport's own errors
        reason = describe(exc)
    folder = snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=[])  # the folder only
    log.info("model source %s: the hub did not answer (%s): using this node's cached %s", repo, reason, folder)
    names = [os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files]
    return os.path.basename(folder), names, folder


def _entry_dir(uri: str, folder: str = "") -> str:
    name = re.sub(r"[^\w.-]", "_", uri.rstrip("/").rsplit("/", 1)[-1])[:64]
    return os.path.join(cache_root(), folder, f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}")


def _complete(entry: str) -> bool:
    """A renamed-into-place entry whose files still have the sizes its manifest records (one whose manifest
    names no file to `use` was chosen by older rules: fetched again)."""
    try:
        with open(os.path.join(entry, MANIFEST)) as f:
            manifest = json.load(f)
        return isinstance(manifest["use"], str) and all(
            os.path.getsize(os.path.join(entry, rel)) == meta["size"] for rel, meta in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def _local(entry: str) -> str:
    """The entry's directory, or its GGUF."""
    with open(os.path.join(entry, MANIFEST)) as f:
        return os.path.normpath(os.path.join(entry, json.load(f)["use"]))


def fetch_uri(uri: str, part: str) -> Fetched | None:
    """An object-store file or prefix (PARTS: all of it, or the META files in an entry of their own) in this
    node's cache (see the module docstring); None for a GGUF's check."""
    import fsspec

    whole, meta = _entry_dir(uri), _entry_dir(uri + "#meta")
    for entry in (whole,) if part == "model" else (whole, meta):  # the whole source serves every part
        if _complete(entry):
            return Fetched(_local(entry), False)
    fs, root = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache(root)  # the filesystem instance is shared: a listing it kept may be stale
    listing = _listing(fs, root.rstrip("/"), is_gguf(uri))
    sel = Selection((), tuple(listing), True) if is_gguf(uri) else select(uri, listing)
    if sel.gguf and part == "check":
        return None
    index = json.loads(fs.cat_file(listing[INDEX]["name"])) if part == "model" and INDEX in sel.meta else None
    try:
        files = sel.files(part, index)
    except ValueError as exc:
        raise ModelSourceError(f"model source {uri!r}: {exc}") from None
    entry = whole if part == "model" or sel.gguf else meta
    return _cached(uri, entry, {rel: listing[rel] for rel in files}, sel.weights[0] if sel.gguf else ".",
                   _store_get(fs))


def _store_get(fs) -> Callable[[str, dict, str], None]:
    """_cached's download of one listed object of `fs` (its info from the listing) into a local path."""
    return lambda rel, info, dest: download(fs, info["name"], int(info["size"]), store_md5(fs, info), dest)


def _listing(fs, root: str, single: bool) -> dict[str, dict]:
    """{file name: the store's info} of the object `root` (a .gguf URI), else of the prefix's top level."""
    if single:
        return {os.path.basename(root): fs.info(root)}
    return {os.path.basename(i["name"].rstrip("/")): i for i in fs.ls(root, detail=True) if i.get("type") == "file"}


def _cached(uri: str, entry: str, files: dict[str, dict], use: str, get: Callable[[str, dict, str], None]) -> Fetched:
    """`files` ({name: info with its size}) downloaded by `get(name, info, dest)` into `entry` under the node's
    lock, unless another process did it meanwhile."""
    from filelock import FileLock, Timeout

    os.makedirs(os.path.dirname(entry), exist_ok=True)
    lock = FileLock(entry + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("model source %s: waiting for another process's download of %s", uri, entry)
        lock.acquire()
    try:
        if _complete(entry):  # another replica on this node fetched it while we waited
            return Fetched(_local(entry), False)
        partial = entry + ".partial"
        shutil.rmtree(partial, ignore_errors=True)  # a crashed download's leftovers: redone from scratch
        shutil.rmtree(entry, ignore_errors=True)  # an entry that failed its size check
        os.makedirs(partial)
        t0, total = time.monotonic(), sum(int(i["size"]) for i in files.values())
        log.info("model source %s: downloading %d files, %.1f MB", uri, len(files), total / 1e6)
        for rel, info in files.items():
            get(rel, info, os.path.join(partial, rel))
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump({"source": uri, "use": use, "files": {r: {"size": int(i["size"])} for r, i in files.items()}}, f)
        os.rename(partial, entry)  # atomic: the entry exists only complete
        log.info("model source %s: %.1f MB in %.2f s -> %s", uri, total / 1e6, time.monotonic() - t0, entry)
        return Fetched(_local(entry), True)
    finally:
        lock.release()
