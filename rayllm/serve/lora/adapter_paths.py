"""Which adapter directories a client may name (`lora_path`, the load route): only those under `lora.allowed_roots`.

Every refusal is the same error, whatever the reason (outside the roots, a symlink or `..` leading out,
missing, not a directory; a remote source that is a root itself or has an empty, `.` or `..` segment, and,
found by the replica before it downloads anything, one without the adapter files at its top level or with
files larger than an adapter for this server can be), so a client learns nothing about the server's files. With no roots
configured, paths from clients are refused outright; the adapters the operator lists in
`lora.adapters` are loaded whatever the roots.
"""

from __future__ import annotations

import os

from rayllm.loader import model_sources
from rayllm.protocol.errors import APIError

REFUSED = "lora_path is not an adapter directory this server may load"
DISABLED = ("loading LoRA adapters by path is off on this server (the operator lists the directories "
            "clients may name in lora.allowed_roots)")


def refused(param: str = "lora_path") -> APIError:
    return APIError(400, REFUSED, param=param, code="invalid_lora_adapter")


def resolve_allowed(path: str, roots: tuple[str, ...] | list[str], param: str = "lora_path") -> str:
    """The canonical path (symlinks and `..` resolved) of an existing directory under one of `roots`,
    or the uniform 400."""
    if not roots:
        raise APIError(400, DISABLED, param=param, code="lora_path_disabled")
    if not isinstance(path, str) or not path or "\x00" in path:
        raise refused(param)
    if remote_source(path):
        return allowed_remote(path, roots, param)
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if os.path.commonpath([base, real]) == base and os.path.isdir(real):
            return real
    raise refused(param)


def remote_source(path: str) -> bool:
    """An object-store URI or a Hugging Face id (`hf://org/name` or `org/name` that is no local path)."""
    return path.startswith("hf://") or model_sources.is_remote(path)


def canonical_remote(source: str) -> str | None:
    """A remote source in its one spelling, `scheme://a/b` (a bare Hugging Face id `org/name` as `hf://org/name`,
    no trailing `/`), or None when a segment is empty, `.` or `..`, or it holds `?` or `#`: fsspec reads
    `x/`, `x//` and `x` as one prefix, and `root//` as the root itself, so each spelling would be another
    cache entry of the same files (or the root's listing)."""
    scheme, sep, rest = source.partition("://")
    if not sep:
        scheme, rest = "hf", source
    segments = rest.rstrip("/").split("/")
    if not scheme or any(s in ("", ".", "..") or "?" in s or "#" in s for s in segments):
        return None
    return f"{scheme.lower()}://{'/'.join(segments)}"


def allowed_remote(source: str, roots: tuple[str, ...] | list[str], param: str = "lora_path") -> str:
    """A remote adapter source strictly under a remote root (`s3://bucket/adapters/`, `hf://org/`), in its
    canonical spelling (the replica fetches it into its node's cache), or the uniform 400: the root itself
    is no adapter (fetching it would list every adapter under it)."""
    canonical = canonical_remote(source)
    if canonical is None:
        raise refused(param)
    for root in roots:
        base = canonical_remote(root) if "://" in root else None
        if base is not None and canonical.startswith(base + "/"):
            return canonical
    raise refused(param)
