"""The server's pure-ASGI middleware: API-key check, 415 for compressed bodies, the body-size limit, and
counting every response (``atomtool:http_requests_total``), 500s included; :class:`Traffic` counts requests in
flight for ``atomtool serve``'s shutdown report.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from atomtool.serve.api.errors import APIError, BodyTooLarge, content_codings, too_large, unsupported_coding
from atomtool.serve.api.metrics import ServerMetrics

logger = logging.getLogger("atomtool.serve")

KNOWN_ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                   "/detokenize", "/version", "/ping")
#: Request-body limit in bytes (``atomtool serve --max-request-bytes``): 16 MiB holds a prompt of two
#: million tokens as text or ids, far beyond any context window; larger bodies get a 413.
DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class CorsPolicy:
    """Cross-origin requests the server allows (vLLM's ``--allowed-origins``, ``--allowed-methods``,
    ``--allowed-headers``, ``--allow-credentials``, with vLLM's defaults: any origin, method and header, no
    credentials), enforced by Starlette's ``CORSMiddleware`` outside the API-key check, so a browser's preflight
    ``OPTIONS`` needs no key (as in vLLM)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class Traffic:
    """HTTP requests the app is serving now (``in_flight``) and those cancelled mid-way (``cancelled``: a
    forced shutdown, the second Ctrl-C, cancels every request task); ``atomtool serve`` reports them."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.cancelled = 0


class AuthAndCount:
    """Pure-ASGI middleware: Bearer-key check on ``/v1/*``, the 415 for a compressed request body
    (:func:`unsupported_coding`), the request-body size limit, a response counter by status, and the
    last-resort 500 for an unexpected exception (counted, logged once).

    (Pure ASGI rather than ``@app.middleware`` so streaming responses and disconnect detection pass
    through untouched. It sits inside Starlette's ServerErrorMiddleware, which would otherwise answer
    the 500 after this counter and have uvicorn log the traceback a second time.)
    """

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, traffic: Traffic | None = None) -> None:
        self.app, self.api_key, self.metrics, self.max_body_bytes = app, api_key, metrics, max_body_bytes
        self.traffic = traffic or Traffic()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in KNOWN_ENDPOINTS:
            endpoint = path
        elif path.startswith("/v1/models/"):
            endpoint = "/v1/models/{model}"
        else:
            endpoint = "other"
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                        self.api_key.encode()):
                err = APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                self.metrics.http_requests.labels(endpoint=endpoint, status="401").inc()
                await err.response()(scope, receive, send)
                return

        codings = content_codings(scope.get("headers") or [])
        if codings:
            self.metrics.http_requests.labels(endpoint=endpoint, status="415").inc()
            await unsupported_coding(codings)(scope, receive, send)
            return

        limit = self.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            self.metrics.http_requests.labels(endpoint=endpoint, status="413").inc()
            await too_large(limit).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:  # a chunked body has no Content-Length: count as it arrives
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        started = False

        async def counting_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        self.traffic.in_flight += 1
        try:
            await self.app(scope, limited_receive, counting_send)
        except asyncio.CancelledError:
            self.traffic.cancelled += 1
            raise
        except BodyTooLarge:
            if not started:
                await too_large(limit).response()(scope, receive, counting_send)
        except Exception as exc:
            logger.exception("request %s %s failed", scope.get("method", ""), path)
            if not started:
                await APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                               type="server_error").response()(scope, receive, counting_send)
        finally:
            self.traffic.in_flight -= 1

