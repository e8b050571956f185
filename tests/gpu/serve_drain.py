"""Graceful drain on the GPU, the last stage of tests/gpu/serve_device.sh: streams of the 8B-shaped model are
open when the app is deleted (as a rolling update or `serve shutdown` stops its replicas); every stream must
run to its last token, and the app must be gone afterwards. Prints one JSON line; exits 1 on a failure.

    python tests/gpu/serve_drain.py URL MODEL [--streams 8] [--tokens 1024] [--app llm]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx


class Stream(threading.Thread):
    def __init__(self, url: str, model: str, tokens: int, i: int) -> None:
        super().__init__(daemon=True)
        self.body = {"model": model, "messages": [{"role": "user", "content": f"Tell a long story, number {i}."}],
                     "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}
        self.url = url
        self.started = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []
        self.error = ""

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body, timeout=300) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    def completion_tokens(self) -> int:
        if self.status != 200 or not self.lines or self.lines[-1] != "data: [DONE]":
            return -1
        events = [json.loads(line[6:]) for line in self.lines[:-1]]
        if any("error" in e for e in events):
            return -1
        return (events[-1].get("usage") or {}).get("completion_tokens", -1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--app", default="llm")
    args = ap.parse_args(argv)
    import ray
    from ray import serve

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    streams = [Stream(args.url, args.model, args.tokens, i) for i in range(args.streams)]
    for s in streams:
        s.start()
    for s in streams:
        s.started.wait(120)
    t0 = time.monotonic()
    serve.delete(args.app, _blocking=False)
    deleting_while_open = False
    while any(s.is_alive() for s in streams):
        status = serve.status().applications.get(args.app)
        deleting_while_open |= status is not None and status.status == "DELETING" and any(s.is_alive() for s in streams)
        time.sleep(0.1)
    drained_s = time.monotonic() - t0
    while args.app in serve.status().applications and time.monotonic() - t0 < 120:
        time.sleep(0.5)
    tokens = [s.completion_tokens() for s in streams]
    result = {"check": "drain", "streams": len(streams), "tokens": args.tokens, "completed": sum(t == args.tokens for t in tokens),
              "completion_tokens": tokens, "deleting_while_open": deleting_while_open,
              "streams_done_after_delete_s": round(drained_s, 2),
              "app_gone": args.app not in serve.status().applications,
              "errors": [s.error or (s.lines[-2:] if s.completion_tokens() != args.tokens else "") for s in streams]}
    print(json.dumps(result), flush=True)
    ok = result["completed"] == len(streams) and deleting_while_open and result["app_gone"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
