"""The pages: ``GET /`` (the web page: generate and score from a browser) and ``GET /docs`` (the API, a page of its
own that works offline: no script or style from elsewhere)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from txl.serve.http import docs_page


def router(schema: Callable[[], dict[str, Any]]) -> APIRouter:
    """The pages; ``schema()``: the app's OpenAPI schema (what /docs shows)."""
    api = APIRouter()

    @api.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("txl.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @api.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> str:
        return docs_page(schema())

    return api
