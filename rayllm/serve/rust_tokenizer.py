"""A model's tokenizer served by the Rust `tokenizers` library alone, without importing transformers (which
imports torch: seconds of CPU in each process that tokenizes, on the first token's path at start-up).

The first load of a model's tokenizer goes through transformers (rayllm.serve.chat_template.load_tokenizer),
which saves a snapshot of it beside its cache: the Rust backend as transformers holds it once loaded, and the
special tokens, ids and chat template transformers derived. Later loads build a `RustTokenizer` from that
snapshot; it answers the calls the serving code makes (encode, decode, vocabulary, special ids, chat
templates) as transformers' tokenizer does: its encode and decode are the same backend calls transformers
makes, and its chat templates render through transformers' own jinja renderer (transformers.utils, no torch).
A tokenizer class that changes any of those calls gets no snapshot, and keeps loading through transformers.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SNAPSHOT_FILE = "rayllm-tokenizer-snapshot.json"
_FORMAT = 1

# What RustTokenizer re-implements. Each must resolve to transformers' generic fast-tokenizer code: a class
# that overrides one of them may tokenize or render differently, so it is not snapshotted.
_MIRRORED = ("__call__", "encode", "_encode_plus", "set_truncation_and_padding", "decode", "_decode",
             "convert_ids_to_tokens", "convert_tokens_to_ids", "_convert_token_to_id_with_added_voc", "get_vocab",
             "__len__", "added_tokens_decoder", "special_tokens_map", "apply_chat_template", "get_chat_template")


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """The libraries a snapshot was made with: another version of either may tokenize differently."""
    from importlib.metadata import version

    return {"transformers": version("transformers"), "tokenizers": version("tokenizers")}


def snapshottable(tok: PreTrainedTokenizerBase) -> bool:
    """A fast tokenizer whose every mirrored call is transformers' generic one."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    from transformers.utils import chat_template_utils

    if not isinstance(tok, PreTrainedTokenizerFast) or getattr(tok, "_tokenizer", None) is None:
        return False
    if not all(hasattr(chat_template_utils, f) for f in ("render_jinja_template", "_normalize_chat_messages")):
        return False  # a transformers without the renderer RustTokenizer calls: served by transformers
    generic = (PreTrainedTokenizerFast, PreTrainedTokenizerBase)
    for name in _MIRRORED:
        owner = next((c for c in type(tok).__mro__ if name in c.__dict__), None)
        if owner not in generic:
            return False
    return True


def save_snapshot(tok: PreTrainedTokenizerBase, directory: str) -> bool:
    """Writes `tok`'s snapshot into `directory` (atomically: a reader sees all of it or none). False when the
    tokenizer cannot be snapshotted or the directory is not writable."""
    if not snapshottable(tok):
        return False
    template = getattr(tok, "chat_template", None)
    data = {"format": _FORMAT, "versions": versions(), "backend": tok.backend_tokenizer.to_str(),
            "special_tokens_map": dict(tok.special_tokens_map),
            "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "unk_token_id": tok.unk_token_id,
            "all_special_ids": list(tok.all_special_ids),
            "split_special_tokens": bool(getattr(tok, "split_special_tokens", False)),
            "chat_template": template if isinstance(template, (str, dict)) else None}
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".snapshot-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(directory, SNAPSHOT_FILE))
    except OSError:
        return False
    return True


def load_snapshot(directory: str) -> RustTokenizer | None:
    """The tokenizer from `directory`'s snapshot; None when there is none, or it was made by other versions
    of transformers or tokenizers (the caller then loads through transformers, which writes a new one)."""
    path = os.path.join(directory, SNAPSHOT_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("format") != _FORMAT or data.get("versions") != versions():
        return None
    return RustTokenizer(data, directory)


class RustTokenizer:
    """The part of transformers' fast tokenizer that serving uses, on the snapshot's Rust backend.

    `_tokenizer` / `backend_tokenizer` is the Rust `tokenizers.Tokenizer` (rayllm.serve.detokenizer calls it
    directly, as it does a transformers fast tokenizer's)."""

    def __init__(self, data: dict, name_or_path: str):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(data["backend"])
        # As transformers' encode sets them on every call without padding or truncation arguments.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = data["split_special_tokens"]
        self._tokenizer = backend
        self.name_or_path = name_or_path
        self.special_tokens_map: dict[str, str] = data["special_tokens_map"]
        self.eos_token_id: int | None = data["eos_token_id"]
        self.bos_token_id: int | None = data["bos_token_id"]
        self.unk_token_id: int | None = data["unk_token_id"]
        self.all_special_ids: list[int] = data["all_special_ids"]
        self.chat_template: str | dict[str, str] | None = data["chat_template"]

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    # ---- vocabulary ----

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tokenizer.get_added_tokens_decoder()

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        def one(token: str) -> int | None:
            index = self._tokenizer.token_to_id(token)
            return self.unk_token_id if index is None else index

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # ---- encode, decode ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False, **_: Any) -> str:
        """transformers' decode of one sequence (other keyword arguments are ignored there too, for a fast
        tokenizer); its clean-up of tokenization spaces is not offered (the serving code never asks for it)."""
        if clean_up_tokenization_spaces:
            raise ValueError("RustTokenizer does not clean up tokenization spaces")
        return self._tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                      skip_special_tokens=skip_special_tokens)

    # ---- chat templates ----

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """transformers' choice: a named template of a dict of them, else the given one, else the model's."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Available "
                                 f"template names are {sorted(own)}.")
        elif chat_template is None:
            if own is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set "
                                 "and no template argument was passed!")
            return own
        return chat_template

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """transformers' apply_chat_template for one conversation (not a batch, no control-token sanitizing,
        no assistant mask), rendered by transformers' own renderer."""
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"):
            raise ValueError("RustTokenizer renders one conversation at a time")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(conversation)], tools=tools, documents=documents,
            chat_template=template, return_assistant_tokens_mask=False,
            continue_final_message=continue_final_message, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        text = rendered[0]
        return self.encode(text, add_special_tokens=False) if tokenize else text


def warm_chat_templates() -> None:
    """Imports the renderer now (about a second on a busy core), rather than in the first request."""
    import transformers.utils.chat_template_utils  # noqa: F401
