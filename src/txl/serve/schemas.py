"""The request bodies of ``txl serve`` (their JSON schemas are the API's), the limits that bound one request's work,
and what the schema says of both: a client, or a fuzzer, reads there exactly what the server accepts."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from txl.config import MAX_SEED, ServeLimits  # noqa: F401  (ServeLimits: re-exported)
from txl.data.tokenizer import UnknownPolicy
from txl.serve.engine import MAX_LOGPROBS

TokenId = Annotated[int, Field(ge=0)]
"""A token id (below the model's vocabulary size, which the server checks)."""
StopString = Annotated[str, Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]


def _whole_numbers(value: Any) -> Any:
    """A number written with a zero fraction (1.0), also inside lists, as the integer it is (JSON Schema counts it
    as one); everything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


class _Request(BaseModel):
    """A request body, read strictly as its JSON schema says (with each model's strict mode): no true/false or
    string where an integer is meant (pydantic's lax mode would read them as 1/0 or parse them), no integer where a
    boolean is meant; an integer may be written 1.0."""

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: _whole_numbers(v) if k in cls.model_fields and "int" in str(cls.model_fields[k].annotation) else v
            for k, v in data.items()
        }


STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "JSON, or with stream: true server-sent events (data: JSON per event, then data: [DONE])",
        "content": {
            "text/event-stream": {
                "schema": {  # (one event)
                    "type": "object",
                    "properties": {"data": {"type": "string", "description": "The event's JSON, or [DONE] last."}},
                    "required": ["data"],
                }
            }
        },
    }
}


class OpenAIPenalties(_Request):
    """OpenAI's penalties, taken by both generation endpoints."""

    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's score once the new text holds it."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted from a token's score per time the new text holds it."
    )
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = Field(  # (JSON's keys are strings)
        None, description="Added to the scores of these token ids (-100: never; 100: always)."
    )


class GenerateRequest(OpenAIPenalties):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    prompt: str | None = Field(None, min_length=1, description="Prompt text (read with the model's tokenizer).")
    prompt_ids: list[TokenId] | None = Field(None, min_length=1, description="Prompt token ids, instead of prompt.")
    max_new_tokens: int = Field(64, ge=0, description="Tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Random seed: the same seed gives the same text.")
    stop: list[StopString] = Field(default_factory=list, description="Stop before the first of these strings.")
    mem_len: int | None = Field(
        None, ge=1, description="Memory length (default: the model's; at most the server's max_mem_len)."
    )
    stream: bool = Field(False, description="Stream the tokens as server-sent events.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="Hugging Face's: the log-probability of a token already in the prompt or the text "
        "is multiplied by this (1: none)."
    )  # fmt: skip
    no_repeat_ngram_size: int = Field(0, ge=0, description="Never repeat an n-gram of this many tokens (0: off).")
    num_beams: int = Field(
        1, ge=1, description="Beam search with this many beams, as Hugging Face's generate() (needs temperature 0; "
        "at most the server's max_batch): the likeliest text of max_new_tokens tokens, cut before the first stop "
        "string; its first token is sent when the search ends, other requests go on meanwhile (a step of each "
        "beside each step of the search), and a streaming client that leaves stops it."
    )  # fmt: skip
    length_penalty: float = Field(
        1.0, ge=-10.0, le=10.0,
        description="Beam search: a finished text's score is its log-probability over its length to this power.",
    )  # fmt: skip
    unknown: UnknownPolicy | None = Field(
        None, description="Characters outside the model's vocabulary: error (a 400 naming the first one) or replace "
        "(read as the tokenizer's replacement symbol); default: the server's --unknown."
    )  # fmt: skip


class CompletionRequest(OpenAIPenalties):
    """OpenAI's completions request. Fields of OpenAI's that txl does not have are refused when set to anything
    but their neutral value; fields unknown to OpenAI too are ignored, as clients send some of their own."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = Field(None, description="The served model's name (GET /v1/models); default: that model.")
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | Ids | Annotated[list[Ids], Field(min_length=1)] = Field(
        ..., description="Text or token ids; a list of them for several prompts (a choice each, in order)."
    )
    max_tokens: int | None = Field(16, ge=0, description="Tokens to generate (OpenAI's default: 16).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature, 0 to 2 (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    stop: StopString | list[StopString] | None = Field(None, description="Stop before the first of these strings.")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Random seed: choice k of a prompt samples with seed + k."
    )
    echo: bool = Field(False, description="Give the prompt's text (and with logprobs, its tokens') first.")
    stream: bool = Field(False, description="Stream the text as server-sent events, ending with data: [DONE].")
    n: int = Field(
        1, ge=1, description="Completions per prompt; n times the number of prompts is at most the server's max_queue."
    )
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Give each token's log-probability and this many most likely tokens at its place.",
    )  # fmt: skip
    best_of: int | None = None
    suffix: str | None = None
    user: str | None = None
    unknown: UnknownPolicy | None = Field(
        None, description="txl's: characters outside the vocabulary, error or replace."
    )


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize`` request (lm-evaluation-harness's remote tokenizer)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: str = Field(..., description="The text to encode with the model's tokenizer.")
    add_special_tokens: bool = Field(False, description="Accepted for vLLM's clients: txl adds no special tokens.")
    unknown: UnknownPolicy | None = Field(None, description="Characters outside the vocabulary: error or replace.")


class DetokenizeRequest(_Request):
    """vLLM's ``/detokenize`` request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    tokens: list[TokenId] = Field(..., description="Token ids to decode.")


class ScoreRequest(_Request):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    text: str | None = Field(
        None,
        min_length=1,
        description="The text to score (up to the server's max_score_tokens), read with the model's tokenizer.",
    )
    ids: list[TokenId] | None = Field(
        None, min_length=2, description="Token ids to score, instead of text (the first one is only context)."
    )
    tgt_len: int | None = Field(
        None, ge=1, description="Segment length (default: the run's evaluation settings; at most the server's "
        "max_tgt_len)."
    )  # fmt: skip
    mem_len: int | None = Field(
        None, ge=0, description="Memory length (default: the run's evaluation settings; at most max_mem_len)."
    )
    clamp_len: int | None = Field(
        None, ge=-1, le=2**31 - 1, description="Clamp relative distances above this (-1: none)."
    )
    same_length: bool | None = Field(None, description="Every query sees mem_len keys.")
    per_token: bool = Field(False, description="Also return every token with its log-probability.")
    zero_memory: bool = Field(False, description="Start from mem_len zero vectors, as Hugging Face's TransfoXL did.")
    unknown: UnknownPolicy | None = Field(None, description="Characters outside the vocabulary: error or replace.")


def field_error(e: RequestValidationError) -> tuple[str, str | None]:
    """The one-line message of a request that does not match its schema, and the first field at fault."""
    parts, params = [], []
    for err in e.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('msg', 'invalid')})")
            continue  # (its location is a character offset, not a field: serve_attack.md B3)
        elif not loc and err.get("type") in ("model_attributes_type", "dict_type"):
            why = "a JSON object, sent with Content-Type: application/json (curl: -H 'Content-Type: application/json')"
            parts.append(f"the request body must be {why}")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"{'.'.join(loc)}: unknown field")
        else:
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
        if loc:
            params.append(".".join(loc))
    return "; ".join(parts), (params[0] if params else None)


def document_limits(components: dict[str, Any], lim: ServeLimits) -> None:
    """Write the server's limits into the request schemas (``maximum``, ``maxItems``, ``maxLength``), so that a
    client (or a fuzzer) sees them; the limits that count tokens (prompts, scored texts) are only in the text."""

    def bound(model: str, field: str, **limits: int) -> None:
        prop = components.get(model, {}).get("properties", {}).get(field)
        if prop is None:
            return
        for branch in prop.get("anyOf", [prop]):  # (an optional field: its non-null branch)
            for key, value in limits.items():
                if branch.get("type") == {"maximum": "integer", "maxItems": "array", "maxLength": "string"}[key]:
                    branch[key] = min(value, branch.get(key, value))
                if key == "maxLength" and branch.get("type") == "array":  # (a list of stop strings)
                    branch.setdefault("items", {})["maxLength"] = value

    bound("GenerateRequest", "max_new_tokens", maximum=lim.max_new_tokens)
    bound("GenerateRequest", "mem_len", maximum=lim.max_mem_len)
    bound("GenerateRequest", "num_beams", maximum=lim.max_batch)
    bound("GenerateRequest", "stop", maxItems=lim.max_stops, maxLength=lim.max_stop_chars)
    bound("CompletionRequest", "max_tokens", maximum=lim.max_new_tokens)
    bound("CompletionRequest", "n", maximum=max(1, lim.max_queue))
    bound("CompletionRequest", "stop", maxItems=lim.max_stops, maxLength=lim.max_stop_chars)
    bound("ScoreRequest", "tgt_len", maximum=lim.max_tgt_len)
    bound("ScoreRequest", "mem_len", maximum=lim.max_mem_len)


class MusicRequest(_Request):
    """A piece from a music model (REMI events): continue a MIDI file, or start from nothing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    midi: str | None = Field(
        None, min_length=1, description="A MIDI file to continue, base64 (its notes as the tokenizer reads them: "
        "all tracks merged, on its grid; at most the server's max_prompt_tokens events)."
    )  # fmt: skip
    prompt_ids: list[TokenId] | None = Field(None, min_length=1, description="Token ids to continue, instead of midi.")
    bars: int | None = Field(8, ge=1, description="Stop after this many new bars (null: after max_new_tokens).")
    max_new_tokens: int = Field(1024, ge=1, description="Most new events (at most the server's max_new_tokens).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int = Field(0, ge=0, description="Keep the k most likely events (0: all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold (1: off).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Random seed: the same seed gives the same piece.")
    grammar: bool = Field(
        True, description="Keep the piece valid REMI (false: sample freely, and count the invalid events)."
    )
