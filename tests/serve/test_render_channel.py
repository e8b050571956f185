"""The tokenizer replica's direct render channel (rayllm/serve/render_channel.py), server and client in this
process's threads with the real SmolLM2 tokenizer (no Ray): the ids equal transformers' apply_chat_template."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from rayllm.serve.render_channel import RenderChannel, RenderServer
from rayllm.serve.tokenizer import TokenizerService

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Persona: terse."}, {"role": "user", "content": "Ça va? 東京 🎉 \"quoted\" \\ \n"},
     {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Und jetzt?"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
]


@pytest.fixture(scope="module")
def server(gguf_path):
    server = RenderServer({"m": TokenizerService(gguf_path)})
    yield server
    server.close()


def test_pipelined_renders_equal_apply_chat_template(server, hf_tokenizer):
    async def main() -> list:
        channel = await RenderChannel.connect(server.path)
        calls = [channel.render("m", m, {}) for m in CONVERSATIONS]
        calls += [channel.render("m", m, {"add_generation_prompt": False}) for m in CONVERSATIONS]
        calls.append(channel.render("m", CONVERSATIONS[0], {"add_generation_prompt": False,
                                                             "continue_final_message": True}))
        calls.append(channel.render("other", CONVERSATIONS[0], {}))
        # Only the model's own template renders here (a request's goes to the sandbox): chat_template is ignored.
        calls.append(channel.render("m", CONVERSATIONS[0], {"chat_template": "{{ 'x' }}"}))
        return await asyncio.gather(*calls)

    out = asyncio.run(main())
    for i, result in enumerate(out[:6]):
        messages, add = CONVERSATIONS[i % 3], i < 3
        if i % 3 == 2:  # developer -> system, text parts joined: what the tokenizer deployment renders
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert result == (hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add),
                          hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add,
                                                           return_dict=False)), i
    assert isinstance(out[6], ValueError) and "assistant" in str(out[6])
    assert isinstance(out[7], ValueError) and "no tokenizer for model 'other'" in str(out[7])
    assert out[8] == out[0]


def test_closed_channel_raises_connection_error(gguf_path):
    server = RenderServer({"m": TokenizerService(gguf_path)})

    async def main() -> None:
        channel = await RenderChannel.connect(server.path)
        assert (await channel.render("m", CONVERSATIONS[0], {}))[1]
        server.close()  # the replica goes: the open connection ends with it
        with pytest.raises(ConnectionError):
            for _ in range(100):  # until the reader sees the end of the stream
                await channel.render("m", CONVERSATIONS[0], {})
                await asyncio.sleep(0.01)
        assert channel.closed

    asyncio.run(main())


def test_a_render_that_fails_fails_alone_and_the_channel_serves_on(server):
    # Not a shape the ingress lets through (its request model checks tool_calls): a stand-in for a fault of ours.
    broken = [{"role": "assistant", "content": "x", "tool_calls": [5]}]

    async def main() -> tuple:
        channel = await RenderChannel.connect(server.path)
        out = await asyncio.gather(channel.render("m", broken, {}), channel.render("m", CONVERSATIONS[0], {}))
        return *out, await channel.render("m", CONVERSATIONS[0], {}), channel.closed

    bad, good, again, closed = asyncio.run(main())
    assert isinstance(bad, RuntimeError) and "TypeError" in str(bad)  # a server error, for this request only
    assert good == again and good[1] and not closed


def test_a_large_render_does_not_hold_back_the_renders_behind_it(server, hf_tokenizer):
    big = [{"role": "user", "content": ("Grüße aus Köln! 東京 🎉 " * 40000)[:600_000]}]

    async def main() -> tuple:
        channel = await RenderChannel.connect(server.path)
        done: list[str] = []

        async def render(name: str, messages: list[dict]) -> tuple:
            result = await channel.render("m", messages, {})
            done.append(name)
            return result

        big_result, _ = await asyncio.gather(render("big", big), render("small", CONVERSATIONS[0]))
        return done, big_result

    done, (text, ids) = asyncio.run(main())
    assert done == ["small", "big"]  # sent second on the same connection, answered first
    assert text == hf_tokenizer.apply_chat_template(big, tokenize=False, add_generation_prompt=True)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)


def test_a_replica_dropped_at_interpreter_exit_leaves_neither_its_directory_nor_a_wait():
    """A tokenizer replica object that lives until its process exits (the server's loop thread, a daemon, is
    gone by the time the module's objects are dropped): close() waits for nothing then (it waited its 5 s
    bound and raised, leaving the socket's directory behind) and the directory goes."""
    script = textwrap.dedent("""
        from rayllm.serve.render_channel import RenderServer

        class Replica:  # as TokenizerDeployment holds its channel
            def __init__(self):
                self.channel = RenderServer({})

            def __del__(self):
                self.channel.close()

        replica = Replica()
        print(replica.channel._dir)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert not os.path.exists(out.stdout.strip())
