"""Model and adapter sources other than a local path: a Hugging Face id, or an object-store URI (s3://,
gs://, abfs://) read through fsspec. Each is downloaded once per node into a local cache and then used as a
local path. No torch.

Hugging Face ids (`org/name`, `org/name@revision`, `org/name/file.gguf` for one GGUF of a repo) go through
huggingface_hub, which keeps its own cache and honours HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE; only the
files a model needs are fetched (config, tokenizer, safetensors; or the one GGUF named).

Object-store URIs go to RAYLLM_MODEL_CACHE (default ~/.cache/rayllm/models): the needed files are read in
parallel byte ranges into `<entry>.partial`, checked (size, and MD5 where the store's ETag is one), and the
directory is renamed into place only when complete, so a crashed download never looks complete and is
redone. A file lock makes replicas on one node download once; the others wait and use the result.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("rayllm.loader")

URI_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "az")
# What a model or a PEFT adapter needs from a repository or prefix (weights, config, tokenizer).
NEEDED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
          "chat_template.json", "*.safetensors", "*.safetensors.index.json", "adapter_config.json", "*.gguf")
HF_ID = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<file>/[^@]+\.gguf)?(?:@(?P<rev>[\w./-]+))?$")
CHUNK_BYTES = 32 << 20
WORKERS = 8
MANIFEST = ".rayllm-manifest.json"


class ModelSourceError(FileNotFoundError):
    """A model or adapter source that cannot be fetched; the message names the source."""


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


def spec(source: str, revision: str | None) -> str:
    """One string naming a source and its revision (`org/name@rev`), for a replica to fetch again."""
    return f"{source}@{revision}" if revision and not uri_scheme(source) and "@" not in source else source


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("RAYLLM_MODEL_CACHE") or os.path.join(base, "rayllm", "models")


@dataclass(frozen=True)
class Fetched:
    path: str  # local file (a GGUF) or directory
    downloaded: bool  # False: it was already in this node's cache


def fetch(source: str, revision: str | None = None) -> Fetched:
    """The local copy of `source`, downloaded first if this node does not have it."""
    if uri_scheme(source):
        return fetch_uri(source)
    m = HF_ID.match(source)
    if m is None:
        raise ModelSourceError(f"model source {source!r} is not a local path, a Hugging Face id or an "
                               f"{'/'.join(s + '://' for s in URI_SCHEMES[:3])} URI")
    return fetch_hf(source, m["repo"], (m["file"] or "").lstrip("/") or None, m["rev"] or revision)


def fetch_hf(source: str, repo: str, filename: str | None, revision: str | None) -> Fetched:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    t0 = time.monotonic()
    try:
        if filename:
            path = hf_hub_download(repo, filename, revision=revision)
        else:
            path = snapshot_download(repo, revision=revision, allow_patterns=list(NEEDED))
    except GatedRepoError:
        raise ModelSourceError(f"model source {source!r}: gated on Hugging Face; accept its terms and set "
                               "HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"model source {source!r}: no such Hugging Face repository, or it is private "
                               "and HF_TOKEN does not grant access") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"model source {source!r}: revision {revision!r} not found") from None
    except LocalEntryNotFoundError:
        raise ModelSourceError(f"model source {source!r}: not in the Hugging Face cache and the hub is not "
                               "reachable (HF_HUB_OFFLINE, or no network)") from None
    except HfHubHTTPError as exc:
        raise ModelSourceError(f"model source {source!r}: Hugging Face answered {exc}".splitlines()[0]) from None
    if not filename and not os.path.isfile(os.path.join(path, "config.json")) and not _ggufs(path):
        raise ModelSourceError(f"model source {source!r}: the repository has no config.json or GGUF file")
    if not filename and not os.path.isfile(os.path.join(path, "config.json")):
        path = _one_gguf(source, path)
    log.info("model source %s: %s (%.2f s)", source, path, time.monotonic() - t0)
    return Fetched(path, True)


def _ggufs(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".gguf"))


def _one_gguf(source: str, path: str) -> str:
    ggufs = _ggufs(path)
    if len(ggufs) != 1:
        raise ModelSourceError(f"model source {source!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
                               "name one as <source>/<file>.gguf")
    return os.path.join(path, ggufs[0])


def _entry_dir(uri: str) -> str:
    name = re.sub(r"[^\w.-]", "_", uri.rstrip("/").rsplit("/", 1)[-1])[:64]
    return os.path.join(cache_root(), f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}")


def _complete(entry: str) -> bool:
    """A renamed-into-place entry whose files still have the sizes the manifest records."""
    try:
        with open(os.path.join(entry, MANIFEST)) as f:
            files = json.load(f)["files"]
        return all(os.path.getsize(os.path.join(entry, rel)) == meta["size"] for rel, meta in files.items())
    except (OSError, ValueError, KeyError):
        return False


def _local(entry: str, single: bool) -> str:
    if not single:
        return entry
    with open(os.path.join(entry, MANIFEST)) as f:
        return os.path.join(entry, next(iter(json.load(f)["files"])))


def fetch_uri(uri: str) -> Fetched:
    """An object-store file or prefix in this node's cache (see the module docstring)."""
    import fsspec
    from filelock import FileLock

    entry = _entry_dir(uri)
    single = uri.lower().endswith(".gguf")
    if _complete(entry):
        return Fetched(_local(entry, single), False)
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    with FileLock(entry + ".lock"):
        if _complete(entry):  # another replica on this node fetched it while we waited
            return Fetched(_local(entry, single), False)
        try:
            fs, root = fsspec.core.url_to_fs(uri)
            files = _listing(fs, root.rstrip("/"), single)
        except ImportError:  # fsspec names the backend package it needs
            raise ModelSourceError(f"model source {uri!r}: its filesystem is not installed (pip install "
                                   "'rayllm-tp[storage]': s3fs, gcsfs, adlfs)") from None
        except (FileNotFoundError, PermissionError, OSError) as exc:
            raise ModelSourceError(f"model source {uri!r}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
        if not files:
            raise ModelSourceError(f"model source {uri!r}: no model files there (config.json, safetensors, GGUF)")
        partial = entry + ".partial"
        shutil.rmtree(partial, ignore_errors=True)  # a crashed download's leftovers: redone from scratch
        shutil.rmtree(entry, ignore_errors=True)  # an entry that failed its size check
        os.makedirs(partial)
        t0, total = time.monotonic(), sum(f["size"] for f in files.values())
        log.info("model source %s: downloading %d files, %.1f MB", uri, len(files), total / 1e6)
        for rel, info in files.items():
            _download(fs, info, os.path.join(partial, rel), uri)
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump({"source": uri, "files": {r: {"size": i["size"]} for r, i in files.items()}}, f)
        os.rename(partial, entry)  # atomic: the entry exists only complete
        log.info("model source %s: %.1f MB in %.2f s -> %s", uri, total / 1e6, time.monotonic() - t0, entry)
        return Fetched(_local(entry, single), True)


def _listing(fs, root: str, single: bool) -> dict[str, dict]:
    """{relative path: {name, size, etag}} of the needed files at `root` (a file, or a prefix)."""
    if single:
        info = fs.info(root)
        return {os.path.basename(root): {"name": root, "size": int(info["size"]), "etag": _etag(info)}}
    found = fs.find(root, detail=True)
    out = {}
    for name, info in found.items():
        rel = name[len(root):].lstrip("/") if name.startswith(root) else os.path.basename(name)
        if rel and ".." not in rel.split("/") and any(fnmatch.fnmatch(os.path.basename(rel), p) for p in NEEDED):
            if not rel.endswith(".gguf") or "/" not in rel:
                out[rel] = {"name": name, "size": int(info["size"]), "etag": _etag(info)}
    return out


def _etag(info: dict) -> str | None:
    """The object's MD5 in hex: an S3 ETag that is one (single-part uploads), GCS's base64 md5Hash (composite
    objects have none) or Azure's Content-MD5 (set by single-shot uploads); else None."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if re.fullmatch(r"[0-9a-f]{32}", etag):
        return etag
    azure_md5 = (info.get("content_settings") or {}).get("content_md5")
    if isinstance(azure_md5, (bytes, bytearray)) and len(azure_md5) == 16:
        return bytes(azure_md5).hex()
    try:
        raw = base64.b64decode(str(info.get("md5Hash") or ""), validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 16 else None


def _download(fs, info: dict, dest: str, uri: str) -> None:
    """One object in parallel byte ranges written at their offsets, then its size (and MD5) checked."""
    size = info["size"]
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def chunk(start: int) -> int:
            data = fs.cat_file(info["name"], start=start, end=min(start + CHUNK_BYTES, size))
            os.pwrite(fd, data, start)
            return len(data)

        with ThreadPoolExecutor(WORKERS) as pool:
            got = sum(pool.map(chunk, range(0, size, CHUNK_BYTES)))
    finally:
        os.close(fd)
    if got != size or os.path.getsize(dest) != size:
        raise ModelSourceError(f"model source {uri!r}: {info['name']} came back with {got} of {size} bytes")
    if info.get("etag"):
        md5 = hashlib.md5(usedforsecurity=False)
        with open(dest, "rb") as f:
            while block := f.read(8 << 20):
                md5.update(block)
        if md5.hexdigest() != info["etag"]:
            raise ModelSourceError(f"model source {uri!r}: {info['name']} failed its MD5 check")
