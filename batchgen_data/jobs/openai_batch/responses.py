"""Output lines of an OpenAI Batch job: each input line's response, in the API's shapes.

A line that ran gives ``{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body"}, "error": null}``, its body a ``chat.completion``, a ``text_completion`` (one choice per
prompt) or an embedding ``list``, each with ``usage`` (``prompt_tokens``, ``completion_tokens``,
``total_tokens``, ``prompt_tokens_details.cached_tokens``). A bad request gives its 4xx status
and an error body, as a server answers it; a line that is not a request at all (not JSON, no
``custom_id``, a repeated ``custom_id``) gives ``response: null`` and an ``error`` object.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

from batchgen_data.jobs.openai_batch.requests import CHAT, EMBEDDINGS, BatchLine, LineError


def line_id(job_id: str, line: BatchLine) -> str:
    """A stable id per output line (a rerun of the job writes the same ids)."""
    return hashlib.sha256(f"{job_id}\0{line.line}".encode()).hexdigest()[:24]


def error_output(line: BatchLine, job_id: str, error: LineError) -> dict:
    rid = line_id(job_id, line)
    if not line.parsed:  # not a request: no HTTP response to give
        return {"id": f"batch_req_{rid}", "custom_id": line.custom_id, "response": None,
                "error": {"code": error.code, "message": str(error)}}
    body = {"error": {"message": str(error), "type": "invalid_request_error", "param": None, "code": error.code}}
    return {"id": f"batch_req_{rid}", "custom_id": line.custom_id,
            "response": {"status_code": error.status, "request_id": f"req_{rid}", "body": body}, "error": None}


def response_output(line: BatchLine, job_id: str, results: list[dict], created: int) -> dict:
    """The output line of a line whose rows ran (``results``: their output rows, in order). A
    row that failed in the engine (a prompt too long, a constraint that cannot compile) makes
    the line a 400 with the row's error."""
    for result in results:
        if result.get("__inference_error__"):
            return error_output(line, job_id, LineError(result["__inference_error__"], code="invalid_prompt"))
    rid = line_id(job_id, line)
    if line.url == EMBEDDINGS:
        body = _embeddings(line, results)
    elif line.url == CHAT:
        body = _chat(line, results[0], rid, created)
    else:
        body = _completions(line, results, rid, created)
    return {"id": f"batch_req_{rid}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{rid}", "body": body}, "error": None}


def usage_of(results: list[dict]) -> dict:
    prompt = sum(r.get("num_input_tokens") or 0 for r in results)
    completion = sum(r.get("num_generated_tokens") or 0 for r in results)
    cached = sum(r.get("num_cached_tokens") or 0 for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _chat(line: BatchLine, result: dict, rid: str, created: int) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": result["generated_text"]},
              "logprobs": None, "finish_reason": _finish(result)}
    if line.logprobs is not None:
        choice["logprobs"] = {"content": [_chat_token(position, line.logprobs)
                                          for position in result.get("logprobs") or []], "refusal": None}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": line.model,
            "choices": [choice], "usage": usage_of([result])}


def _completions(line: BatchLine, results: list[dict], rid: str, created: int) -> dict:
    choices = []
    for index, result in enumerate(results):
        choice = {"index": index, "text": result["generated_text"], "logprobs": None,
                  "finish_reason": _finish(result)}
        if line.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(result.get("logprobs") or [], line.logprobs)
        choices.append(choice)
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": line.model,
            "choices": choices, "usage": usage_of(results)}


def _embeddings(line: BatchLine, results: list[dict]) -> dict:
    data = []
    for index, result in enumerate(results):
        values = [float(v) for v in result["embeddings"]]
        embedding: Any = values
        if line.encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
            embedding = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = usage_of(results)
    return {"object": "list", "data": data, "model": line.model,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"]}}


def _finish(result: dict) -> str:
    reason = result.get("finish_reason")
    return reason if reason in ("stop", "length") else "stop"


def _entries(position: list[dict] | None, k: int) -> tuple[dict, list[dict]]:
    """A position's token (its first entry) and its ``k`` most likely (by rank)."""
    position = position or []
    top = sorted({e["token_id"]: e for e in position}.values(), key=lambda e: (e["rank"], e["token_id"]))
    return position[0], top[:k]


def _chat_token(position: list[dict], k: int) -> dict:
    chosen, top = _entries(position, k)

    def item(entry: dict) -> dict:
        text = entry["decoded_token"] or ""
        return {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode("utf-8", "replace"))}

    return {**item(chosen), "top_logprobs": [item(e) for e in top]}


def _completion_logprobs(positions: list, k: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for position in positions:
        chosen, top = _entries(position, k)
        text = chosen["decoded_token"] or ""
        tokens.append(text)
        token_logprobs.append(chosen["logprob"])
        top_logprobs.append({(e["decoded_token"] or ""): e["logprob"] for e in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
