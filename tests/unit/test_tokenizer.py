"""Chat template rendering and incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from deployments.tokenizer import IncrementalDetokenizer, TokenizerService

TEXT = "Hello wörld 🎉 — naïve café, 東京タワー. The capital of France is Paris. END"


@pytest.fixture(scope="module")
def svc(gguf_path) -> TokenizerService:
    return TokenizerService(gguf_path)


def feed(det: IncrementalDetokenizer, ids: list[int]) -> tuple[str, str | None]:
    out, matched = [], None
    for i in ids:
        text, m = det.add([i])
        out.append(text)
        matched = matched or m
    return "".join(out), matched


def test_chat_template_renders_chatml(svc):
    text, ids = svc.render_chat([{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == svc.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_continue_final_message_leaves_turn_open(svc):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    text, _ = svc.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello the")
    with pytest.raises(ValueError):
        svc.render_chat(msgs[:1], add_generation_prompt=False, continue_final_message=True)


def test_developer_role_is_rendered_as_system(svc):
    text, _ = svc.render_chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_incremental_detokenizer_equals_full_decode(svc):
    ids = svc.encode(TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, svc.encode("Say:", False))
    text, matched = feed(det, ids)
    assert matched is None
    assert text + det.flush() == svc.decode(ids)
    assert "\ufffd" not in text


def test_stop_string_spanning_tokens_is_caught_and_never_leaked(svc):
    ids = svc.encode(TEXT, add_special_tokens=False)
    stop = "France is Par"
    assert len(svc.encode(stop, False)) > 1
    det = IncrementalDetokenizer(svc.tokenizer, [], stop=(stop, "never"))
    text, matched = feed(det, ids)
    assert matched == stop
    assert text == TEXT[: TEXT.index(stop)]
    keep = IncrementalDetokenizer(svc.tokenizer, [], stop=(stop,), include_stop_str_in_output=True)
    assert feed(keep, ids)[0] == TEXT[: TEXT.index(stop) + len(stop)]


def test_held_back_prefix_is_flushed_when_no_stop_matches(svc):
    ids = svc.encode("The end is near", add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop=("near!",))
    text, matched = feed(det, ids)
    assert matched is None and not text.endswith("near")
    assert text + det.flush() == "The end is near"


def test_stop_regex(svc):
    ids = svc.encode(TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(r"capital of \w+",))
    text, matched = feed(det, ids)
    assert matched == "capital of France"
    assert text == TEXT[: TEXT.index("capital")]


def test_token_bytes_reassemble_utf8(svc):
    ids = svc.encode("café 🎉", add_special_tokens=False)
    raw = b"".join(bytes(b) for b in svc.token_bytes(ids))
    assert raw.decode("utf-8") == "café 🎉"
    assert svc.tokenizer.convert_tokens_to_ids("<|im_end|>") in svc.eos_token_ids
