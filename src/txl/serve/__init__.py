"""Serving: the HTTP application (``app``), the batching engine (``engine``), the HTTP layer (``http``) and the
web page (``static/``). Imports inference and below; not train or interop.

``txl.serve`` was one module before the redesign; its public names stay importable from here."""

from txl.serve.app import (
    CompletionRequest,
    DetokenizeRequest,
    DrainingServer,
    GenerateRequest,
    ScoreRequest,
    ServeLimits,
    Server,
    TokenizeRequest,
    create_app,
)
