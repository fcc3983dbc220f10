"""``txl serve``: an HTTP API (FastAPI) over a trained model, with a web page, batched streaming generation and
long-text scoring. Design notes: docs/internals.md#txlserveapp."""

from __future__ import annotations

import asyncio
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from txl.data.tokenizer import UnknownPolicy
from txl.serve import routes_openai, routes_pages, routes_txl
from txl.serve.http import ERROR_RESPONSES, ApiError, Gate, error_body
from txl.serve.schemas import (
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ScoreRequest,
    ServeLimits,
    TokenizeRequest,
    document_limits,
    field_error,
)
from txl.serve.state import Server
from txl.serve.streams import ClientLeft

PUBLIC = frozenset({"/health", "/", "/docs", "/openapi.json"})
"""The paths that need no API key."""

__all__ = [
    "CompletionRequest", "DetokenizeRequest", "DrainingServer", "GenerateRequest", "ScoreRequest", "ServeLimits",
    "Server", "TokenizeRequest", "create_app",
]  # fmt: skip


def create_app(
    model_dir: str | Path,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    *,
    unknown: UnknownPolicy = "error",
    served_names: list[str] | None = None,
    quantization: str | None = None,
) -> FastAPI:
    """The FastAPI app of ``txl serve`` for one model (the engine starts and stops with the app's lifespan);
    ``device``: cpu, cuda, cuda:N or auto (the GPU if there is one); ``unknown``: the default policy for characters
    outside the vocabulary (error or replace); ``served_names``: the model names OpenAI's ``model`` field may give
    (default: the folder's name and ``txl``); ``quantization``: the model's Linear layers in int8
    (:func:`txl.infer.quantize.quantize`)."""
    server = Server(
        model_dir, limits or ServeLimits(), api_key, device, unknown=unknown, served_names=served_names,
        quantization=quantization,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.shutdown)

    app = FastAPI(
        title="txl serve", description=f"Transformer-XL model {server.served_names[0]}", lifespan=lifespan,
        docs_url=None, redoc_url=None, responses=ERROR_RESPONSES, redirect_slashes=False,  # (B5: /docs/ is a 404)
    )  # fmt: skip
    app.state.server = server
    app.add_middleware(
        Gate, api_key=lambda: server.api_key, max_body_bytes=lambda: server.limits.max_body_bytes,
        stall_timeout=lambda: server.limits.stream_timeout, public=PUBLIC, on_start=server.response_started,
        on_end=server.response_ended,
    )  # fmt: skip
    app.openapi = _schema(app, server)
    _handle_errors(app)
    app.include_router(routes_txl.router(server))
    app.include_router(routes_openai.router(server))
    app.include_router(routes_pages.router(app.openapi))
    return app


def _schema(app: FastAPI, server: Server):
    """FastAPI's schema, less the 422 it documents for bad bodies (they are 400s here), with this server's limits as
    the request fields' maxima and, with an API key, the bearer authentication every non-public path needs."""
    schema_of = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = schema_of()
            for path, methods in schema["paths"].items():
                for op in methods.values():
                    op.get("responses", {}).pop("422", None)
                    if server.api_key and path not in PUBLIC:
                        op["security"] = [{"bearer": []}]
            if server.api_key:
                schemes = schema["components"].setdefault("securitySchemes", {})
                schemes["bearer"] = {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer KEY"}
            document_limits(schema["components"]["schemas"], server.limits)
        return app.openapi_schema

    return openapi


def _handle_errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape (:mod:`txl.serve.http`); a client that left gets nothing."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        message, param = field_error(e)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientLeft)
    async def client_left(request: Request, e: ClientLeft):
        return Response(status_code=408)  # (nobody reads it: the client is gone)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {str(e.detail).lower()}"
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # (the traceback goes to the server's log)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM / SIGINT drains the :class:`Server` ``state`` (:meth:`Server.drain`: no
    new requests, the ones in flight finish or end with finish_reason shutdown within ``drain_timeout``) before
    uvicorn stops; a second one stops at once. ``clean``: whether the drain ended everything cleanly (None: no
    signal came)."""

    def __init__(self, config: uvicorn.Config, state: Server, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout, self.clean = state, drain_timeout, None
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None:  # (a second signal: stop now)
            super().handle_exit(sig, frame)
            return
        print(f"txl serve: shutting down: the requests in flight run for at most {self.drain_timeout:g} s more, then "
              "end with a final event",
              file=sys.stderr, flush=True)  # fmt: skip
        self._drainer = threading.Thread(target=self._drain, name="txl-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        self.clean = self.state.drain(self.drain_timeout)
        self.should_exit = True
