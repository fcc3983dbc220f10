"""The HTTP plumbing of ``txl serve`` around its endpoints: OpenAI's error bodies, the gate every request passes
(the API key, the body-size limit, the count of responses in flight) and the offline API page at ``/docs``.

Every error, on every endpoint, is OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with
OpenAI's status codes (400 invalid request, 401 no or wrong key, 404 unknown model or path, 413 body too large, 429
busy, 500 the server failed the request, 503 shutting down or failed), so OpenAI's clients show the message.
"""

from __future__ import annotations

import hmac
import html
import json
from collections.abc import Awaitable, Callable
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


async def send_json(send: Callable[[dict], Awaitable[None]], status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class Gate:
    """ASGI middleware in front of the app. Checks the API key (``Authorization: Bearer KEY`` only: a key in the URL
    would leak into history, Referer headers and proxy logs) on every path but ``public``; refuses a body larger
    than ``max_body_bytes()`` with a 413 before the app reads it; and counts the responses in flight
    (``on_start()``/``on_end(complete)``: complete when the response's last byte was sent)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: Callable[[], str | None],
        max_body_bytes: Callable[[], int],
        public: frozenset[str],
        on_start: Callable[[], None],
        on_end: Callable[[bool], None],
    ):
        self.app, self.api_key, self.max_body_bytes, self.public = app, api_key, max_body_bytes, public
        self.on_start, self.on_end = on_start, on_end

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self._refused(scope, headers)
        if refused is not None:
            await send_json(send, refused.status, refused.body())
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

        complete = False

        async def sending(message: dict) -> None:
            nonlocal complete
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        self.on_start()
        try:
            await self.app(scope, replay, sending)
        finally:
            self.on_end(complete)

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
