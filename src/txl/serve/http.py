"""The HTTP plumbing of ``txl serve`` around its endpoints: OpenAI's error bodies, the gate every request passes
(the API key, the body-size limit, the count of responses in flight) and the offline API page at ``/docs``.
Design notes: docs/internals.md#txlservehttp."""

from __future__ import annotations

import asyncio
import hmac
import html
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str = Field(..., description="What went wrong, in one line, naming the field where one is at fault.")
    type: str = Field(..., description="invalid_request_error, authentication_error, rate_limit_error, ...")
    param: str | None = Field(None, description="The request field at fault, if one is.")
    code: str | None = Field(None, description="A machine-readable code (model_not_found, invalid_api_key, ...).")


class ErrorBody(BaseModel):
    """Every error response (OpenAI's shape)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": kind.replace("_", " ")}
    for status, kind in ERROR_TYPES.items()
    if status != 405
}
"""The error responses every endpoint may give (for the OpenAPI schema)."""


class ApiError(Exception):
    """An error response: ``status``, a one-line ``message``, the field at fault (``param``) and a ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, str(self), self.param, self.code)


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    """A 400 for one field: its message begins with the field's name."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse_error(error: dict[str, Any]) -> str:
    """The last two events of a stream that failed: the error (OpenAI's shape) and ``[DONE]``."""
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


async def send_json(
    send: Callable[[dict], Awaitable[None]], status: int, body: dict[str, Any], close: bool = False
) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class Gate:
    """ASGI middleware in front of the app. Checks the API key (``Authorization: Bearer KEY`` only: a key in the URL
    would leak into history, Referer headers and proxy logs) on every path but ``public``; refuses a body larger
    than ``max_body_bytes()`` with a 413 before the app reads it; answers HEAD as GET without the body; closes a
    response whose client has read nothing for ``stall_timeout()`` seconds (a send that waits that long for room in
    the connection's buffer: the connection is closed, and the request's work cancelled); and counts the responses
    in flight (``on_start()``/``on_end(complete)``: complete when the response's last byte was sent)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: Callable[[], str | None],
        max_body_bytes: Callable[[], int],
        public: frozenset[str],
        on_start: Callable[[], None],
        on_end: Callable[[bool], None],
        stall_timeout: Callable[[], float] = lambda: 30.0,
    ):
        self.app, self.api_key, self.max_body_bytes, self.public = app, api_key, max_body_bytes, public
        self.on_start, self.on_end, self.stall_timeout = on_start, on_end, stall_timeout

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD":  # (the server sends no body for HEAD: uvicorn drops it)
            scope = dict(scope, method="GET")
        raw = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", [])]
        headers = dict(raw)
        refused = self._ambiguous(raw) or self._refused(scope, headers)
        if refused is not None:
            close = refused.code == "ambiguous_request"  # (nothing after it on this connection is read)
            await send_json(send, refused.status, refused.body(), close=close)
            return
        limit = self.max_body_bytes()
        body, more = bytearray(), True
        while more:  # (read the whole body first: one too large is refused before any of it is parsed)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await send_json(send, 413, self._too_large(limit).body())
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # (then the client's disconnect, which a streaming response listens for)

        complete = stalled = False

        async def sending(message: dict) -> None:
            nonlocal complete, stalled
            try:
                await asyncio.wait_for(send(message), self.stall_timeout())
            except TimeoutError:
                stalled = True
                raise _Stalled() from None
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        self.on_start()
        try:
            await self.app(scope, replay, sending)
        except Exception:
            if not stalled:
                raise
            # (returning without the response's end makes the server close the connection; the app's stream was
            # closed on the way out, which cancelled its generation)
        finally:
            self.on_end(complete)

    @staticmethod
    def _ambiguous(raw: list[tuple[str, str]]) -> ApiError | None:
        """A request whose headers can be read two ways (serve_attack.md B7, B8): two Authorization headers (the
        last one won), or a body framed by both Content-Length and Transfer-Encoding (a proxy that reads the length
        and this server, which reads the chunks, would see different requests). Refused, and the connection closed."""
        names = [k for k, _ in raw]
        if names.count("authorization") > 1:
            return ApiError(400, "two Authorization headers: send the key once", code="ambiguous_request")
        if "content-length" in names and "transfer-encoding" in names:
            return ApiError(400, "both Content-Length and Transfer-Encoding: frame the body one way",
                            code="ambiguous_request")  # fmt: skip
        return None

    def _refused(self, scope: dict, headers: dict[str, str]) -> ApiError | None:
        key = self.api_key()
        if key and scope["path"] not in self.public:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                where = " (a key in the URL is not read: it would leak into logs)" if b"key=" in scope.get(
                    "query_string", b""
                ) else ""  # fmt: skip
                return ApiError(
                    401, f"missing or wrong API key: send it as the header Authorization: Bearer KEY{where}",
                    code="invalid_api_key",
                )  # fmt: skip
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes()):
            return self._too_large(self.max_body_bytes())
        return None

    @staticmethod
    def _too_large(limit: int) -> ApiError:
        return ApiError(
            413, f"the request body is larger than the server's limit of {limit:,} bytes (--max_body_bytes)"
        )


class _Stalled(Exception):
    """A response's client read nothing for the stall timeout."""


def docs_page(schema: dict[str, Any]) -> str:
    """The API as one self-contained HTML page (no script, nothing fetched from elsewhere): each endpoint with its
    description and its request fields (name, type, default, description)."""
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{html.escape(schema['info']['title'])}: API</title>",
        "<style>body{font:15px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "code{background:#f3f3f3;padding:0 .2em}table{border-collapse:collapse;width:100%}"
        "td,th{border-bottom:1px solid #ddd;padding:.3em;text-align:left;vertical-align:top}</style></head><body>",
        f"<h1>{html.escape(schema['info']['title'])}</h1><p>{html.escape(schema['info'].get('description', ''))}</p>",
        "<p>The machine-readable schema: <a href='/openapi.json'>/openapi.json</a>. Errors on every endpoint: "
        '<code>{"error": {"message", "type", "param", "code"}}</code>.</p>',
    ]
    components = schema.get("components", {}).get("schemas", {})
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            parts.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
            text = op.get("description") or op.get("summary") or ""
            parts.append(f"<p>{html.escape(text)}</p>")
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            if ref:
                fields = components.get(ref.rsplit("/", 1)[-1], {}).get("properties", {})
                rows = "".join(
                    f"<tr><td><code>{html.escape(name)}</code></td><td>{html.escape(_type_name(f))}</td>"
                    f"<td>{html.escape(json.dumps(f['default']) if 'default' in f else 'required')}</td>"
                    f"<td>{html.escape(f.get('description', ''))}</td></tr>"
                    for name, f in fields.items()
                )
                parts.append(f"<table><tr><th>field</th><th>type</th><th>default</th><th></th></tr>{rows}</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _type_name(field: dict[str, Any]) -> str:
    if "anyOf" in field:
        return " | ".join(_type_name(f) for f in field["anyOf"])
    if field.get("type") == "array":
        return f"list[{_type_name(field.get('items', {}))}]"
    if field.get("type") == "object":
        return "object"
    bounds = [f"{op} {field[k]}" for k, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                                               ("exclusiveMaximum", "<")) if k in field]  # fmt: skip
    return field.get("type", "any") + (f" ({', '.join(bounds)})" if bounds else "")


# ---------------------------------------------------------------------------------------------------------------
# Connection timeouts. uvicorn (0.54, h11) closes a connection idle between requests after its keep-alive timeout,
# but waits for ever for a request's headers and body: one connection sending a header byte per second ("slowloris")
# is held open as long as it likes. Its HTTP protocol class is a documented option (uvicorn.Config(http=...)); this
# one adds the missing deadlines and is otherwise uvicorn's.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send a request (each a `txl serve` option)."""

    header_timeout: float = 10.0
    """Seconds from a connection's start (or the end of its previous response) to the end of a request's headers."""
    body_timeout: float = 30.0
    """Seconds from the end of a request's headers to the end of its body."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle connection stays open between two requests."""


REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def timed_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol with ``limits``' header and body deadlines: a request whose headers (or body) are not
    all in by then gets a 408 and its connection is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _deadline = None  # (the timer of the part of a request being waited for)
        _waiting_for = None  # ("headers" or "body")

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._expect("headers")

        def connection_lost(self, exc) -> None:
            self._expect(None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (its keep-alive timer runs until the next request's first byte)
            self._follow()

        def _follow(self) -> None:
            """Which part of a request the connection waits for now, by h11's state of the client's side."""
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._expect("body")
            elif state is h11.IDLE and self.conn.trailing_data[0]:  # (part of the next request's headers)
                self._expect("headers")
            elif state is h11.IDLE and self.timeout_keep_alive_task is None and self.cycle is None:
                self._expect("headers")  # (a new connection that sent nothing yet)
            else:
                self._expect(None)

        def _expect(self, part: str | None) -> None:
            if part == self._waiting_for and part is not None:
                return  # (the deadline runs from when this part began)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._waiting_for = part
            if part is not None:
                seconds = limits.header_timeout if part == "headers" else limits.body_timeout
                self._deadline = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self._waiting_for == "headers" or self.cycle is None or not self.cycle.response_started:
                self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()

    return TimedH11Protocol
