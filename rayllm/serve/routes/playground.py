"""The browser playground: one static page (no build step, no CDN) served at / and /playground.

It talks to the server's own /v1/models and /v1/chat/completions with the API key the person types in
(kept in that tab's sessionStorage only); the page itself holds no secret, so it is served without a key.
"""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import sys
from pathlib import Path

from fastapi.responses import HTMLResponse
from ray import cloudpickle

from rayllm.serve.routes.http_app import app

PAGE = Path(__file__).parent / "static" / "playground.html"
# The page loads nothing from anywhere but this server, and no other site may frame it (a framing page could
# trick a person into typing the API key into it): frame-ancestors works only as a header, not in <meta>.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers without CSP level 2
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# Serve ships the ingress class to its replica by value, with the route signatures it rewrote (`self`
# injected); routes on this mixin must travel the same way, or the replica's copies lack the rewrite.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PlaygroundRoutes:
    """Mixed into rayllm.serve.ingress.Ingress (Serve binds routes declared on any class of its MRO)."""

    @app.get("/")
    async def playground_root(self) -> HTMLResponse:
        return self.playground_page_response()

    @app.get("/playground")
    async def playground(self) -> HTMLResponse:
        return self.playground_page_response()

    def playground_page_response(self) -> HTMLResponse:
        if getattr(self, "_playground_html", None) is None:
            self._playground_html = PAGE.read_text(encoding="utf-8")
        return HTMLResponse(self._playground_html, headers=HEADERS)
