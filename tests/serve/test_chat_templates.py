"""Chat templates against transformers' apply_chat_template with SmolLM2's tokenizer: a model with several named
templates (tokenizer_config.json's list form, as Hermes-2-Pro and Command-R ship), and continuing the final
message through templates that trim or `tojson` it."""

from __future__ import annotations

import json
import os

import pytest

from rayllm.serve.chat_template import ChatRenderer
from rayllm.serve.tokenizer import TokenizerService

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
# A Hermes-style tool template: it names tools and tool_call, so the tools reach it as they are.
TOOL_USE = ("<|im_start|>system\n<tools>{{ tools | tojson }}</tools> Answer with <tool_call>.<|im_end|>\n"
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def named_dir(hf_tokenizer, tmp_path_factory) -> str:
    """SmolLM2's tokenizer saved with two named chat templates, written in tokenizer_config.json's list form."""
    path = str(tmp_path_factory.mktemp("named-templates"))
    default = hf_tokenizer.chat_template
    hf_tokenizer.save_pretrained(path)
    for name in ("chat_template.jinja", "chat_template.json"):  # newer transformers save the template apart
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": TOOL_USE}]
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("load", ["transformers", "snapshot"])
def test_named_templates_render_as_transformers(named_dir, tmp_path, monkeypatch, load):
    from transformers import AutoTokenizer

    monkeypatch.setenv("TOKENIZER_CACHE", str(tmp_path))
    ref = AutoTokenizer.from_pretrained(named_dir)
    assert isinstance(ref.chat_template, dict) and set(ref.chat_template) == {"default", "tool_use"}
    svc = TokenizerService(named_dir)
    if load == "snapshot":  # the second start loads the snapshot the first one saved
        svc = TokenizerService(named_dir)
        assert type(svc.tokenizer).__name__ == "RustTokenizer"
    for tools in (None, TOOLS):
        expected = ref.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
        text, ids = svc.render_chat(MESSAGES, tools=tools)
        assert text == expected
        assert ids == ref.encode(expected, add_special_tokens=False)
    assert "<tools>" in svc.render_chat(MESSAGES, tools=TOOLS)[0]
    assert "<tools>" not in svc.render_chat(MESSAGES)[0]
    assert svc.info()["tool_format"] == "hermes" and svc.info()["reasoning"] is False


def test_named_templates_without_a_default_name_the_choices(hf_tokenizer):
    renderer = ChatRenderer(hf_tokenizer)
    renderer.default_template = {"tool_use": TOOL_USE}
    with pytest.raises(ValueError, match="tool_use"):
        renderer.render(MESSAGES)
    assert renderer.render(MESSAGES, tools=TOOLS).startswith("<|im_start|>system\n<tools>")


CONTINUED = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is "}]
CONTINUE_TEMPLATES = {
    "model": None,  # SmolLM2's own: keeps the content as it is
    "trim": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "tojson": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}",
}


@pytest.mark.parametrize("name", CONTINUE_TEMPLATES)
def test_continue_final_message_equals_transformers(hf_tokenizer, svc_renderer, name):
    template = CONTINUE_TEMPLATES[name]
    expected = hf_tokenizer.apply_chat_template(CONTINUED, chat_template=template, tokenize=False,
                                                continue_final_message=True)
    text = svc_renderer.render(CONTINUED, chat_template=template, add_generation_prompt=False,
                               continue_final_message=True)
    assert text == expected
    assert text.endswith({"model": "The answer is ", "trim": "The answer is", "tojson": '"The answer is '}[name])


@pytest.fixture(scope="module")
def svc_renderer(gguf_path) -> ChatRenderer:
    return TokenizerService(gguf_path).renderer
