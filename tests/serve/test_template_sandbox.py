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
