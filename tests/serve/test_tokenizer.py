"""Chat template rendering and incremental detokenization with the real SmolLM2 tokenizer."""

from __future__ import annotations

import os
import random

import pytest

from rayllm.loader.model_files import DEFAULT_MODEL_NAME, resolve_model_path
from rayllm.serve.chat_template import load_tokenizer
from rayllm.serve.detokenizer import MAX_UNREAD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from rayllm.serve.tokenizer import TokenizerService

TEXT = "Hello wörld 🎉 — naïve café, 東京タワー. The capital of France is Paris. END"
LONG = (
    "Grüße aus Köln! Ça va très bien. Привет, мир. 你好，世界。こんにちは 🌍🚀👩‍💻 مرحبا بالعالم. "
    "नमस्ते दुनिया। Γειά σου Κόσμε. 🇫🇷🇯🇵 x² ≤ ∞ — “quotes” ‘and’ emoji 😀😃😄.\n\n  Indented\tline. "
) * 4
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def svc(gguf_path) -> TokenizerService:
    return TokenizerService(gguf_path)


def feed(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[str, str | None]:
    """Feeds ids in chunks; returns the concatenated emitted text and the first stop match."""
    out, matched = [], None
    for k in range(0, len(ids), chunk):
        text, m = det.add(ids[k : k + chunk])
        assert matched is None or (text, m) == ("", None), "nothing may follow a stop match"
        out.append(text)
        matched = matched or m
    return "".join(out), matched


def test_round_trip_and_special_ids(svc):
    ids = svc.encode("The capital of France is Paris.")
    assert svc.decode(ids) == "The capital of France is Paris."
    im_end = svc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in svc.eos_token_ids
    assert svc.bos_token_id == svc.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert svc.vocab_size == 49152
    assert svc.has_fim_tokens is False  # SmolLM2 has no <fim_*> tokens
    assert svc.info()["eos_token_ids"] == svc.eos_token_ids


def test_chat_template_renders_chatml(svc):
    assert SYSTEM in svc.tokenizer.chat_template  # the template's default system prompt
    text, ids = svc.render_chat([{"role": "user", "content": "Hi"}])
    assert text == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == svc.encode(text, add_special_tokens=False)
    assert ids[0] == svc.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(svc.tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


def test_text_parts_are_joined(svc):
    # Joined with a newline, as vLLM's "string" content format joins them.
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    expected = svc.render_chat([{"role": "user", "content": "Hello\nworld"}])
    assert svc.render_chat([{"role": "user", "content": parts}]) == expected
    with pytest.raises(ValueError, match="image_url"):
        svc.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_continue_final_message_leaves_turn_open(svc):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    text, _ = svc.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello the")
    closed, _ = svc.render_chat(msgs, add_generation_prompt=False)
    assert closed.endswith("Hello the<|im_end|>\n")
    with pytest.raises(ValueError, match="both"):
        svc.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant"):
        svc.render_chat(msgs[:1], add_generation_prompt=False, continue_final_message=True)


def test_roles_and_tool_calls(svc):
    text, _ = svc.render_chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    text, _ = svc.render_chat(msgs, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    # SmolLM2's template knows no tools: they go to the system prompt, calls and results in Hermes tags.
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert '<tools>\n{"name": "f", "parameters": {}}\n</tools>' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
            '<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>') in text


def test_template_errors_are_value_errors(svc):
    with pytest.raises(ValueError, match="chat template"):
        svc.render_chat([{"role": "user", "content": "Hi"}], chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="no system"):
        svc.render_chat([{"role": "user", "content": "Hi"}],
                        chat_template="{{ raise_exception('no system') }}")
    text, _ = svc.render_chat([{"role": "user", "content": "Hi"}], chat_template="{{ greeting }}",
                              chat_template_kwargs={"greeting": "hey", "tokenize": True})
    assert text == "hey"


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_equals_full_decode(svc, chunk):
    ids = svc.encode(LONG, add_special_tokens=False)
    prompt = svc.render_chat([{"role": "user", "content": "Say it."}])[1]
    det = IncrementalDetokenizer(svc.tokenizer, prompt)
    pieces = [det.add(ids[k : k + chunk])[0] for k in range(0, len(ids), chunk)]
    assert "".join(pieces) + det.flush() == svc.decode(ids) == LONG
    assert not any("\ufffd" in p for p in pieces)  # split characters wait for their last byte
    assert chunk > 1 or "" in pieces  # some tokens end mid-character and emit nothing yet
    assert len(det._ids) < 16  # the decode window stays bounded


def test_incomplete_character_at_the_end_is_flushed_like_decode(svc):
    ids = svc.encode("ok 🎉", add_special_tokens=False)[:-1]  # cut inside the emoji's bytes
    det = IncrementalDetokenizer(svc.tokenizer, [])
    text, _ = feed(det, ids)
    assert "\ufffd" not in text
    assert text + det.flush() == svc.decode(ids)


@pytest.mark.parametrize("kind", ["lone bytes", "skipped special tokens"])
def test_a_long_run_that_never_completes_a_character_keeps_the_window_bounded(svc, kind):
    """A model that writes only lone UTF-8 bytes (each decodes to U+FFFD alone; a logit_bias can force one),
    or only special tokens that decode to nothing: the window still slides, so a step's decode stays small
    (it grew with the output before: quadratic), and the text equals the whole output's decode."""
    vocab = svc.info()["vocab_size"]
    lone = next(i for i in range(vocab) if svc.decode([i]) == "\ufffd" and svc.decode([i, i]) == "\ufffd\ufffd")
    tid = lone if kind == "lone bytes" else svc.encode("<|im_end|>", add_special_tokens=False)[0]
    ids = [tid] * 400 + svc.encode(" done", add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, svc.encode("Hi", add_special_tokens=False))
    text, widest = "", 0
    for t in ids:
        text += det.add([t])[0]
        widest = max(widest, len(det._ids))
    assert text + det.flush() == svc.decode(ids)
    assert widest <= 2 * MAX_UNREAD_TOKENS + PROMPT_CONTEXT_TOKENS


def test_special_tokens_skipped_or_kept(svc, hf_tokenizer):
    """As transformers' fast decode (and vLLM's fast detokenizer): kept special tokens get no spaces around
    them, whatever spaces_between_special_tokens says (a slow-tokenizer option)."""
    ids = svc.encode("Hello there<|im_end|>\n<|im_start|>user", add_special_tokens=False)
    assert feed(IncrementalDetokenizer(svc.tokenizer, []), ids)[0] == hf_tokenizer.decode(ids, skip_special_tokens=True)
    kept = hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert kept == "Hello there<|im_end|>\n<|im_start|>user"
    for spaces in (True, False):
        det = IncrementalDetokenizer(svc.tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert feed(det, ids)[0] + det.flush() == kept
    # A stop string spanning a kept special token matches.
    det = IncrementalDetokenizer(svc.tokenizer, [], skip_special_tokens=False, stop=("<|im_end|>\n<|im_start|>",))
    assert feed(det, ids) == ("Hello there", "<|im_end|>\n<|im_start|>")


def test_stop_string_spanning_tokens_is_caught_and_never_leaked(svc):
    ids = svc.encode(TEXT, add_special_tokens=False)
    stop = "France is Par"
    assert len(svc.encode(stop, False)) > 1
    det = IncrementalDetokenizer(svc.tokenizer, [], stop=("never", stop))
    text, matched = feed(det, ids)
    assert matched == stop
    assert text == TEXT[: TEXT.index(stop)]
    assert det.flush() == ""
    keep = IncrementalDetokenizer(svc.tokenizer, [], stop=(stop,), include_stop_str_in_output=True)
    assert feed(keep, ids) == (TEXT[: TEXT.index(stop) + len(stop)], stop)


def test_earliest_stop_wins_across_stop_strings(svc):
    ids = svc.encode(TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop=("Paris", "capital"))
    text, matched = feed(det, ids, chunk=len(ids))  # both arrive in one step
    assert (text, matched) == (TEXT[: TEXT.index("capital")], "capital")


def test_stop_strings_with_random_chunking(svc):
    ids = svc.encode(LONG, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        a = rng.randrange(len(LONG) - 10)
        stop = LONG[a : a + rng.randint(2, 8)]
        if not stop.strip():
            continue
        det = IncrementalDetokenizer(svc.tokenizer, [], stop=(stop,))
        text, matched = feed(det, ids, chunk=rng.randint(1, 4))
        assert matched == stop and text == LONG[: LONG.index(stop)]


def test_held_back_prefix_is_flushed_when_no_stop_matches(svc):
    ids = svc.encode("The end is near", add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop=("near!",))
    text, matched = feed(det, ids)
    assert matched is None and text == "The end is "
    assert det.flush() == "near"
    assert det.add(svc.encode(" more", False)) == ("", None)


def test_stop_regex(svc):
    ids = svc.encode(TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(r"capital of \w+",))
    text, matched = feed(det, ids)
    assert matched == "capital of France"
    assert text == TEXT[: TEXT.index("capital")]
    keep = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(r"\d+ now",), include_stop_str_in_output=True)
    assert feed(keep, svc.encode("Call 555 now!", False)) == ("Call 555 now", "555 now")
    none = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(r"\d{4}",))
    text, matched = feed(none, ids)
    assert matched is None and text + none.flush() == TEXT


def test_token_strings_and_bytes(svc):
    ids = svc.encode("café 🎉<|im_end|>", add_special_tokens=False)
    raw = b"".join(bytes(b) for b in svc.token_bytes(ids))
    assert raw.decode("utf-8") == "café 🎉<|im_end|>"
    strings = svc.token_strings(ids)
    assert strings[0] == "c" and strings[-1] == "<|im_end|>"
    assert "\ufffd" in "".join(strings)  # the emoji is split across byte tokens


def test_resolve_model_path(gguf_path, tmp_path):
    assert resolve_model_path(None) == resolve_model_path(DEFAULT_MODEL_NAME) == gguf_path
    assert resolve_model_path(gguf_path) == gguf_path
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(os.path.dirname(gguf_path))
    with pytest.raises(FileNotFoundError):
        resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_fill_in_the_middle_prompt(svc, gguf_path, tmp_path):
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        svc.encode_fim("def f(", "):")
    # The same tokenizer with StarCoder-style FIM tokens added, saved as a Hugging Face directory.
    tok = load_tokenizer(gguf_path)
    tok.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    tok.save_pretrained(tmp_path)
    fim = TokenizerService(str(tmp_path))
    assert fim.has_fim_tokens and fim.info()["fim_tokens"] == ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    ids = fim.encode_fim("def add(a, b):\n    return ", "\n")
    vocab = fim.tokenizer.get_vocab()
    assert ids[0] == vocab["<fim_prefix>"] and ids[-1] == vocab["<fim_middle>"] and vocab["<fim_suffix>"] in ids
    assert fim.decode(ids, skip_special_tokens=False) == "<fim_prefix>def add(a, b):\n    return <fim_suffix>\n<fim_middle>"


@pytest.mark.parametrize("special", [False, True])
def test_encode_equals_transformers(svc, special):
    """The fast path (straight to the Rust backend) gives what transformers' encode gives."""
    ref = svc.transformers_tokenizer()
    texts = [TEXT, LONG, "", " ", "Hi<|im_end|>\n<|im_start|>user\n x", "\x00\ufffd tabs\tand\nnewlines  "]
    for text in texts:
        assert svc.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    assert svc.encode_batch(texts, special) == [ref.encode(t, add_special_tokens=special) for t in texts]
    text, ids = svc.render_chat([{"role": "user", "content": TEXT}])
    assert ids == ref.encode(text, add_special_tokens=False)


def test_gguf_tokenizer_is_saved_once_and_equals_transformers_rebuild(gguf_path, hf_tokenizer, tmp_path, monkeypatch):
    """The first load rebuilds the tokenizer from the GGUF metadata and saves it; later loads read the saved
    directory. Both equal transformers' own rebuild (hf_tokenizer): vocabulary, rules, specials, template."""
    monkeypatch.setenv("TOKENIZER_CACHE", str(tmp_path))
    first = load_tokenizer(gguf_path)
    (saved,) = tmp_path.iterdir()
    again = load_tokenizer(gguf_path)
    assert again.name_or_path == first.name_or_path == str(saved)
    for tok in (first, again):
        assert tok.backend_tokenizer.to_str() == hf_tokenizer.backend_tokenizer.to_str()
        assert tok.get_vocab() == hf_tokenizer.get_vocab() and len(tok) == len(hf_tokenizer)
        assert tok.chat_template == hf_tokenizer.chat_template
        assert (tok.bos_token, tok.eos_token, tok.all_special_tokens) == (
            hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.all_special_tokens)
        assert tok.encode(LONG) == hf_tokenizer.encode(LONG)


def test_render_chat_batch_equals_apply_chat_template(gguf_path, hf_tokenizer):
    """The batch render the ingress uses (rayllm.serve.render_batcher) gives, request by request, the ids of
    transformers' own apply_chat_template; one request's error comes back in its place, the rest render."""
    import asyncio

    from rayllm.serve.tokenizer import TokenizerDeployment

    deployment = TokenizerDeployment.func_or_class({"m": gguf_path})  # the replica's class, without Serve
    conversations = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": TEXT}],
        [{"role": "user", "content": LONG}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}],
    ]
    bad = ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False, "continue_final_message": True})
    calls = [(conversations[0], {}), bad, (conversations[1], {"add_generation_prompt": False}),
             (conversations[2], {"add_generation_prompt": True})]
    out = asyncio.run(deployment.render_chat_batch("m", calls))
    assert isinstance(out[1], ValueError) and "assistant" in str(out[1])
    for (messages, kw), result in ((calls[i], out[i]) for i in (0, 2, 3)):
        add = kw.get("add_generation_prompt", True)
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add, return_dict=False)
        assert result == (hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add), expected)
        assert result == asyncio.run(deployment.render_chat("m", messages, **kw))  # one by one: the same
    with pytest.raises(ValueError, match="no tokenizer"):
        asyncio.run(deployment.render_chat_batch("other", calls))


DEEP = "[" * 5000 + "]" * 5000  # past json's own recursion limit
# Not a shape the ingress lets through (its request model checks tool_calls): a stand-in for a fault of ours.
BROKEN = [{"role": "assistant", "content": "x", "tool_calls": [5]}]


def _tool_history(arguments: object) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "Call f."}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def test_deeply_nested_tool_call_arguments_render_as_the_clients_text(svc):
    text, ids = svc.render_chat(_tool_history(DEEP))
    assert f'{{"name": "f", "arguments": "{DEEP}"}}' in text  # the client's string, as a malformed one
    assert ids == svc.encode(text, add_special_tokens=False)
    assert '"arguments": {"a": 1}' in svc.render_chat(_tool_history('{"a": 1}'))[0]  # a shallow one: a mapping
    deep: dict = {}
    for _ in range(5000):  # a mapping nested past what json.dumps walks: the client's error, not a RecursionError
        deep = {"a": deep}
    with pytest.raises(ValueError, match="nest too deeply"):
        svc.render_chat(_tool_history(deep))


@pytest.fixture(scope="module")
def deployment(gguf_path):
    from rayllm.serve.tokenizer import TokenizerDeployment

    deployment = TokenizerDeployment.func_or_class({"m": gguf_path})  # the replica's class, without Serve
    yield deployment
    deployment.channel.close()


def test_a_render_that_fails_fails_alone_in_its_batch(deployment, svc):
    import asyncio

    good = [{"role": "user", "content": "Hi"}]
    calls = [(good, {}), (BROKEN, {}), (_tool_history(DEEP), {}), (good, {"add_generation_prompt": False})]
    out = asyncio.run(deployment.render_chat_batch("m", calls))
    assert isinstance(out[1], RuntimeError) and "TypeError" in str(out[1])  # a server error for this one
    assert out[0] == svc.render_chat(good) and out[3] == svc.render_chat(good, add_generation_prompt=False)
    assert out[2] == svc.render_chat(_tool_history(DEEP))


def test_large_inputs_leave_the_event_loop_free(deployment, svc):
    """encode holds the GIL (a megabyte: a second with every other thread stalled): a large input is encoded,
    decoded or rendered in a thread with the GIL released, and the replica's event loop goes on serving."""
    import asyncio
    import time

    big = (LONG * 1000)[:600_000]

    async def main() -> tuple:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.002)
                gaps.append(time.perf_counter() - last)
                last += gaps[-1]

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        ids = await deployment.encode("m", big, add_special_tokens=False)
        text = await deployment.decode("m", ids)
        rendered = await deployment.render_chat("m", [{"role": "user", "content": big}])
        await asyncio.sleep(0.05)  # the ticker's turn: a stall (inline work never yields) shows as one long gap
        tick.cancel()
        return ids, text, rendered, max(gaps)

    ids, text, (rendered, rendered_ids), gap = asyncio.run(main())
    assert gap < 0.2, f"the event loop stalled {gap:.3f} s"
    assert ids == svc.tokenizer.encode(big, add_special_tokens=False)  # the inline path's ids
    assert text == svc.tokenizer.decode(ids, skip_special_tokens=True) == big
    assert rendered == svc.renderer.render([{"role": "user", "content": big}])
    assert rendered_ids == svc.tokenizer.encode(rendered, add_special_tokens=False)
