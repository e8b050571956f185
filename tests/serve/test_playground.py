"""The browser playground, in a real headless Chromium driving the live test server.

Needs Debian's `chromium` package and Playwright's Python package (the `test` extra); without them
the browser tests skip and say why. The streamed answer is checked against the same request made
through the OpenAI SDK (greedy, so both must be equal), and a screenshot is taken: into the test's temporary
folder, or to docs/playground.png (the README's picture) with UPDATE_SCREENSHOT=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"


def _chromium() -> str | None:
    for path in (os.environ.get("CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if path and os.path.exists(path):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        reason = "no Chromium installed (apt-get install chromium, or set CHROMIUM=/path/to/chromium)"
        print(f"\nSKIP playground browser tests: {reason}")
        pytest.skip(reason)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "Playwright's Python package is not installed (pip install -e '.[test]')"
        print(f"\nSKIP playground browser tests: {reason}")
        pytest.skip(reason)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True)
        yield b
        b.close()


def test_page_is_served_and_self_contained(server):
    for path in ("/", "/playground"):
        r = httpx.get(f"{server}{path}")  # no key needed for the page; its API calls carry the key
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        # No CDN: nothing is loaded from another origin.
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", r.text)
        # The policy is a header (frame-ancestors has no effect in a <meta>); no other site may frame the page.
        policy = {d.split()[0]: d.split()[1:] for d in r.headers["content-security-policy"].split("; ")}
        assert policy["default-src"] == ["'self'"] and policy["frame-ancestors"] == ["'none'"]
        assert r.headers["x-frame-options"] == "DENY"


def _open(browser, server, model_name):
    page = browser.new_page(viewport={"width": 1200, "height": 720})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server}/playground")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")  # loads /v1/models with the key
    page.wait_for_selector(f"#model option[value='{model_name}']", state="attached")
    page.select_option("#model", model_name)
    page.fill("#temperature", "0")
    page.dispatch_event("#temperature", "input")
    return page, errors


def _send(page, text: str) -> list[str]:
    """Sends a message; returns every text the answer showed while it streamed in."""
    from playwright.sync_api import expect

    page.evaluate("""() => {
        window.__seen = [];
        new MutationObserver(() => {
            const c = document.querySelector('.msg.assistant:last-of-type .content');
            if (c && c.textContent && window.__seen.at(-1) !== c.textContent) window.__seen.push(c.textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    # expect() polls without eval, which the page's Content-Security-Policy (kept on here) forbids.
    expect(page.locator("#status")).to_have_text("done", timeout=120_000)
    return page.evaluate("window.__seen")


def test_chat_streams_into_the_page(browser, server, client, model_name, tmp_path):
    page, errors = _open(browser, server, model_name)
    page.fill("#max-tokens", "40")
    seen = _send(page, "Write a short sentence about the ocean.")
    answer = page.inner_text(".msg.assistant .content")
    # The same request through the SDK: greedy decoding gives the same text.
    ref = client.chat.completions.create(model=model_name, temperature=0, max_tokens=40, messages=[
        {"role": "user", "content": "Write a short sentence about the ocean."}]).choices[0].message.content
    assert answer == ref and answer
    assert len(seen) > 1 and seen[-1] == answer  # it appeared piece by piece, growing to the whole answer
    assert all(answer.startswith(s) for s in seen)
    assert re.fullmatch(r"\d+\.\d{3} s", page.inner_text("#ttft"))
    assert float(page.inner_text("#tps")) > 0 and int(page.inner_text("#tokens")) > 1
    shot = DOCS_SCREENSHOT if os.environ.get("UPDATE_SCREENSHOT") == "1" else tmp_path / "playground.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 0
    assert not errors
    page.close()


def test_json_schema_and_errors_in_the_page(browser, server, model_name):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    page, errors = _open(browser, server, model_name)
    page.fill("#max-tokens", "60")
    page.fill("#schema", json.dumps(schema))
    _send(page, "Describe Bob.")
    jsonschema.validate(json.loads(page.inner_text(".msg.assistant .content")), schema)
    # A wrong key: the server's error message is shown, not a broken page.
    page.fill("#api-key", "wrong-key")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.error")
    assert "API key" in page.inner_text(".msg.error")
    assert not errors
    page.close()


def test_the_key_stays_in_its_tab_and_no_other_site_can_frame_the_page(browser, server, model_name):
    """The API key is kept in the tab's sessionStorage: a reload keeps it, another tab of the same browser
    profile does not get it, and nothing holds it in localStorage (a key an older page left there is removed
    unread). The other settings are shared through localStorage. A page of another origin cannot frame it."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{server}/playground")
    page.evaluate("() => localStorage.setItem('playground.api-key', 'left-by-an-older-page')")
    page.reload()
    assert page.input_value("#api-key") == ""
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector(f"#model option[value='{model_name}']", state="attached")  # the key works
    page.fill("#max-tokens", "33")
    page.dispatch_event("#max-tokens", "change")
    page.reload()
    assert page.input_value("#api-key") == API_KEY and page.input_value("#max-tokens") == "33"
    stored = page.evaluate("() => [localStorage.getItem('playground.api-key'), sessionStorage.getItem('playground.api-key')]")
    assert stored == [None, API_KEY]
    other = context.new_page()  # a second tab: the settings, not the key
    other.goto(f"{server}/playground")
    assert other.input_value("#api-key") == "" and other.input_value("#max-tokens") == "33"
    # Framed by a page of another origin (here about:blank with the playground in an iframe): refused.
    framer = context.new_page()
    framer.set_content(f'<iframe id="f" src="{server}/playground"></iframe>')
    frame = framer.query_selector("#f").content_frame()
    assert frame is None or frame.query_selector("#api-key") is None
    context.close()
