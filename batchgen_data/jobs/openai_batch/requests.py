"""One line of an OpenAI Batch input file, read into the rows our stages run, or into the error
its output line carries.

A line is ``{"custom_id", "method": "POST", "url", "body"}`` (the OpenAI Batch API's, which
``vllm run-batch`` reads too). ``/v1/chat/completions`` and ``/v1/completions`` become generate
rows (``messages`` / ``prompt`` / ``prompt_token_ids`` and a ``sampling_params`` dict);
``/v1/embeddings`` becomes embed rows (``pooling_params``). A completions or embeddings body
with several prompts gives one row per prompt (its ``index``).

Body fields map onto ``SamplingParams`` in one table (``SAMPLING_FIELDS``): OpenAI's names, and
vLLM's extra sampling fields under their own names. Fields that do not change the output
(``user``, ``metadata``, ...) are ignored; a field this engine cannot honour (``n`` > 1,
``tools``, ``stream``) is the line's error, as is any unknown one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.sampling_params import SamplingParams
from batchgen_data.errors import ConfigError

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
URLS = (CHAT, COMPLETIONS, EMBEDDINGS)
# OpenAI body field -> SamplingParams field (both endpoints that generate).
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
    # vLLM's extra sampling fields, by their names
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output", "bad_words": "bad_words",
    "allowed_token_ids": "allowed_token_ids", "truncate_prompt_tokens": "truncate_prompt_tokens",
    "structured_outputs": "structured_outputs", "guided_decoding": "structured_outputs",
}
# vLLM's older per-kind constraint fields.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Fields that do not change a request's output: accepted and ignored.
IGNORED_FIELDS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options",
                            "parallel_tool_calls", "messages", "prompt", "input", "logprobs", "top_logprobs",
                            "response_format", "n", "best_of", "stream", "echo", "encoding_format",
                            "dimensions"})
# OpenAI's default sampling (vLLM's OpenAI server: temperature and top_p 1.0).
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


class LineError(ConfigError):
    """Why a line gives no response: its HTTP status (400: a bad request, 404: an unknown URL
    or model) and OpenAI's error ``code``."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(slots=True)
class BatchLine:
    """One input line: its ``custom_id``, endpoint and the rows it runs, or its error."""

    line: int  # 0-based, among the file's non-blank lines
    custom_id: str | None = None
    url: str | None = None
    model: str | None = None
    rows: list[dict] = field(default_factory=list)
    logprobs: int | None = None  # top logprobs asked for (chat: top_logprobs; completions: logprobs)
    encoding_format: str = "float"  # embeddings: "float" or "base64"
    error: LineError | None = None
    parsed: bool = True  # False: not a request at all (response null, error object)


def read_line(text: str, line: int, models: tuple[str, ...], max_tokens: int) -> BatchLine:
    """The ``BatchLine`` of one non-blank input line. ``models``: the names the loaded model
    answers to; ``max_tokens``: for bodies that give none."""
    out = BatchLine(line)
    try:
        request = json.loads(text)
    except json.JSONDecodeError as err:
        out.error, out.parsed = LineError(f"line {line + 1} is not JSON: {err.msg}", code="invalid_json"), False
        return out
    if not isinstance(request, dict) or not isinstance(request.get("custom_id"), str):
        out.error, out.parsed = LineError(f"line {line + 1} is not a batch request: it needs a string custom_id"
                                          , code="invalid_request"), False
        return out
    out.custom_id, out.url = request["custom_id"], request.get("url")
    try:
        _read_request(request, out, models, max_tokens)
    except LineError as err:
        out.error, out.rows = err, []
    except ConfigError as err:  # a SamplingParams / PoolingParams field
        out.error, out.rows = LineError(str(err)), []
    return out


def _read_request(request: dict, out: BatchLine, models: tuple[str, ...], max_tokens: int) -> None:
    if request.get("method", "POST") != "POST":
        raise LineError(f"method must be POST, got {request.get('method')!r}", code="invalid_method")
    if out.url not in URLS:
        raise LineError(f"url {out.url!r} is not supported; use one of {list(URLS)}", status=404,
                        code="unsupported_url")
    body = request.get("body")
    if not isinstance(body, dict):
        raise LineError("body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in models:
        raise LineError(f"The model `{model}` does not exist (this job serves {list(models)}).", status=404,
                        code="model_not_found")
    out.model = model if model is not None else models[0]
    known = IGNORED_FIELDS | SAMPLING_FIELDS.keys() | GUIDED_FIELDS.keys()
    unknown = sorted(set(body) - known)
    if unknown:
        raise LineError(f"unsupported body field(s) {unknown}", code="unsupported_field")
    if body.get("stream"):
        raise LineError("stream=true has no meaning in a batch file", code="unsupported_field")
    if out.url == EMBEDDINGS:
        _embedding_rows(body, out)
    else:
        _generate_rows(body, out, max_tokens)


def _generate_rows(body: dict, out: BatchLine, max_tokens: int) -> None:
    for name in ("n", "best_of"):
        if body.get(name, 1) != 1:
            raise LineError(f"{name}={body[name]!r}: one output per request is generated here (n=1)",
                            code="unsupported_field")
    if body.get("echo"):
        raise LineError("echo=true is not supported", code="unsupported_field")
    params = {**OPENAI_DEFAULTS, "max_tokens": max_tokens}
    for name, value in body.items():
        if name in SAMPLING_FIELDS and value is not None:
            params[SAMPLING_FIELDS[name]] = value
        elif name in GUIDED_FIELDS and value is not None:
            params["structured_outputs"] = {GUIDED_FIELDS[name]: value}
    constraint = _response_format(body.get("response_format"))
    if constraint is not None:
        params["structured_outputs"] = constraint
    out.logprobs = _logprobs(body, out.url)
    if out.logprobs is not None:
        params["logprobs"] = out.logprobs
    SamplingParams.from_dict(params)  # a bad value is this line's 400, before the model loads
    if out.url == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise LineError("messages must be a non-empty list")
        out.rows = [{"messages": json.dumps(messages), "sampling_params": json.dumps(params)}]
        return
    out.rows = [{**prompt, "sampling_params": json.dumps(params)} for prompt in _prompts(body.get("prompt"), "prompt")]


def _embedding_rows(body: dict, out: BatchLine) -> None:
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise LineError(f"encoding_format must be 'float' or 'base64', got {encoding!r}")
    out.encoding_format = encoding
    pooling = {} if body.get("dimensions") is None else {"dimensions": body["dimensions"]}
    PoolingParams.from_dict({**pooling, "task": "embed"})
    out.rows = [{**prompt, "pooling_params": json.dumps(pooling)} for prompt in _prompts(body.get("input"), "input")]


def _prompts(value: Any, name: str) -> list[dict]:
    """One row's prompt per prompt of ``value``: a string, a list of strings, a token-id list,
    or a list of token-id lists (OpenAI's forms)."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [{"prompt": v} for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [{"prompt_token_ids": value}]
        if all(isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
               for v in value):
            return [{"prompt_token_ids": v} for v in value]
    raise LineError(f"{name} must be a string, a list of strings, a token-id list or a list of them, "
                    f"got {json.dumps(value)[:80]}")


def _response_format(value: Any) -> dict | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise LineError("response_format json_schema needs json_schema.schema, an object")
        return {"json": schema}
    raise LineError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _logprobs(body: dict, url: str) -> int | None:
    """Top logprobs per token asked for: chat's ``logprobs`` (bool) and ``top_logprobs``,
    completions' ``logprobs`` (an int)."""
    value = body.get("logprobs")
    if url == CHAT:
        if value is None or value is False:
            if body.get("top_logprobs") is not None:
                raise LineError("top_logprobs needs logprobs=true")
            return None
        if value is not True:
            raise LineError(f"logprobs must be a boolean, got {value!r}")
        top = body.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise LineError(f"top_logprobs must be an integer in [0, 20], got {top!r}")
        return top
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
        raise LineError(f"logprobs must be an integer in [0, 5], got {value!r}")
    return value
