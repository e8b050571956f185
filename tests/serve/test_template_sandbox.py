"""Request chat templates in the sandbox process (rayllm.serve.template_sandbox), with the real SmolLM2
tokenizer: same text as the in-process renderer, and hostile templates end in a 400, never a hang."""

from __future__ import annotations

import pytest

from rayllm.protocol.errors import APIError
from rayllm.serve.chat_template import ChatRenderer, load_tokenizer
from rayllm.serve.template_sandbox import TemplateSandbox

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{{ bos_token }}"


@pytest.fixture(scope="module")
def sandbox(gguf_path):
    box = TemplateSandbox(gguf_path, timeout_s=3.0, max_output_chars=100_000)
    yield box
    box.close()


def test_renders_like_the_in_process_renderer(sandbox, gguf_path):
    ref = ChatRenderer(load_tokenizer(gguf_path)).render(MESSAGES, chat_template=PLAIN)
    assert sandbox.render(MESSAGES, chat_template=PLAIN) == ref
    assert ref.startswith("<system>Be brief.</system>")


@pytest.mark.parametrize("template, code", [
    ('{{ "x" * 10**9 }}', "invalid_chat_template|chat_template_timeout"),  # memory, output or time bound
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "chat_template_timeout"),
    ("{% for i in range(99999) %}{{ 'abcdefghij' }}{% endfor %}", "invalid_chat_template"),  # 1M chars out
    ("{% if %}", "invalid_chat_template"),  # syntax error
])
def test_hostile_templates_are_400s_and_the_sandbox_recovers(sandbox, template, code):
    with pytest.raises(APIError) as info:
        sandbox.render(MESSAGES, chat_template=template)
    assert (info.value.status_code, info.value.param) == (400, "chat_template")
    assert info.value.code in code.split("|")
    assert sandbox.render(MESSAGES, chat_template=PLAIN).startswith("<system>")


# About a quarter of a second of CPU per render: a burst of them keeps the child busy for seconds.
SLOW = "{% for i in range(50) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + PLAIN


def test_a_burst_of_request_templates_leaves_the_replicas_threads_free(gguf_path):
    """The requests that wait for the sandbox wait on the event loop, not in the default executor's threads
    (there the replica's large encodes and renders run); beyond MAX_WAITING they are answered 503 busy."""
    import asyncio
    import time

    from rayllm.serve.template_sandbox import MAX_WAITING
    from rayllm.serve.tokenizer import TokenizerDeployment

    deployment = TokenizerDeployment.func_or_class({"m": gguf_path})  # the replica's class, without Serve
    expected = ChatRenderer(load_tokenizer(gguf_path)).render(MESSAGES, chat_template=SLOW)

    async def main() -> tuple:
        await deployment.render_chat("m", MESSAGES, chat_template=SLOW)  # starts the child
        burst = [asyncio.ensure_future(deployment.render_chat("m", MESSAGES, chat_template=SLOW)) for _ in range(16)]
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        await asyncio.to_thread(time.sleep, 0)  # any large input's turn in the default executor
        waited = time.perf_counter() - start
        return waited, await asyncio.gather(*burst, return_exceptions=True)

    try:
        waited, out = asyncio.run(main())
    finally:
        deployment.channel.close()
        deployment.sandboxes["m"].close()
    assert waited < 0.5, f"the default executor was held {waited:.2f} s"
    busy = [r for r in out if isinstance(r, APIError)]
    assert len(busy) == 16 - 1 - MAX_WAITING
    assert all((r.status_code, r.code) == (503, "chat_template_busy") for r in busy)
    assert [r[0] for r in out if not isinstance(r, APIError)] == [expected] * (1 + MAX_WAITING)


PARENT = '''
import sys
from rayllm.serve.template_sandbox import TemplateSandbox

box = TemplateSandbox(sys.argv[1], timeout_s=600.0)
box.render([{"role": "user", "content": "Hi"}], chat_template="{{ messages[0].content }}")
print(box._child._proc.pid, flush=True)
box.render([{"role": "user", "content": "Hi"}], chat_template="{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped running
    except OSError:
        return False


def test_a_runaway_render_dies_with_the_replica(gguf_path):
    """The replica killed outright (SIGKILL: no clean-up of its own runs) takes its sandbox child with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT, gguf_path], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    pid = 0
    try:
        pid = int(parent.stdout.readline())
        time.sleep(0.5)  # the runaway render is under way
        assert _alive(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the sandbox child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
