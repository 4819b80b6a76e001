"""``batchgen-data run-batch``: OpenAI Batch files through the CLI, outputs parsed with the
``openai`` package's own response types, usage adding up to ``OUTPUT.usage.json``, bad lines as
per-line errors, and a job killed with SIGKILL resumed to every line once, in order."""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgen_data import Engine, EngineConfig, SamplingParams
from batchgen_data.jobs.cli import main

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

ENGINE_ARGS = ["--max-num-seqs", "32", "--no-progress"]
SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["late", "broken"]}},
          "required": ["label"], "additionalProperties": False}


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _lines() -> list[str]:
    chat = "/v1/chat/completions"
    return [
        _line("chat-1", chat, {"model": "demo", "messages": [{"role": "user", "content": "Where is my order?"}],
                               "max_tokens": 6, "temperature": 0}),
        _line("cmpl-1", "/v1/completions", {"model": "demo", "prompt": ["Ticket 1: late.", "Ticket 2: broken."],
                                           "max_tokens": 5, "temperature": 0, "logprobs": 2}),
        "",  # blank lines are skipped, as vLLM skips them
        _line("emb-1", "/v1/embeddings", {"model": "demo", "input": ["the blender broke", "late again"]}),
        _line("emb-b64", "/v1/embeddings", {"input": "shipping", "encoding_format": "base64"}),
        _line("json-1", chat, {"messages": [{"role": "user", "content": "Label: arrived late"}], "max_completion_tokens": 24,
                               "temperature": 0, "logprobs": True, "top_logprobs": 2,
                               "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "label", "schema": SCHEMA}}}),
        _line("json-2", chat, {"messages": [{"role": "user", "content": "Label: arrived broken"}], "max_tokens": 24,
                               "temperature": 0, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}),
        "{not json",
        json.dumps({"method": "POST", "url": chat, "body": {}}),  # no custom_id
        _line("chat-1", chat, {"messages": [{"role": "user", "content": "again"}]}),  # repeated custom_id
        _line("bad-url", "/v1/responses", {"input": "hi"}),
        _line("bad-model", chat, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
        _line("bad-n", chat, {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
        _line("bad-field", chat, {"messages": [{"role": "user", "content": "hi"}], "tools": []}),
        _line("bad-temp", "/v1/completions", {"prompt": "hi", "temperature": -1}),
        _line("too-long", "/v1/completions", {"prompt": list(range(5, 4200)), "max_tokens": 2}),
    ]


def _run(tmp_path: Path, lines: list[str], *extra: str) -> tuple[list[dict], dict]:
    source, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(output), *ENGINE_ARGS, *extra]) == 0
    usage = json.loads((tmp_path / "out.jsonl.usage.json").read_text())
    return [json.loads(line) for line in output.read_text().splitlines()], usage


def test_a_mixed_batch_file_runs_unchanged_and_parses_as_openai_responses(tmp_path, demo_path):
    outputs, usage = _run(tmp_path, _lines())
    assert len(outputs) == len([line for line in _lines() if line.strip()])
    assert not (tmp_path / "out.jsonl.parts").exists()
    by_id = {}
    for out in outputs:
        assert set(out) == {"id", "custom_id", "response", "error"} and out["id"].startswith("batch_req_")
        by_id.setdefault(out["custom_id"], out)
    chat = ChatCompletion.model_validate(by_id["chat-1"]["response"]["body"])
    engine = Engine(demo_path, EngineConfig(max_num_seqs=32))
    want = engine.chat([{"role": "user", "content": "Where is my order?"}], SamplingParams(max_tokens=6, temperature=0))
    assert chat.choices[0].message.content == want[0].text and chat.usage.completion_tokens == 6
    completion = Completion.model_validate(by_id["cmpl-1"]["response"]["body"])
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in completion.choices)
    assert all(len(top) <= 2 for c in completion.choices for top in c.logprobs.top_logprobs)
    embeddings = CreateEmbeddingResponse.model_validate(by_id["emb-1"]["response"]["body"])
    assert [d.index for d in embeddings.data] == [0, 1] and len(embeddings.data[0].embedding) > 0
    b64 = by_id["emb-b64"]["response"]["body"]["data"][0]["embedding"]
    raw = base64.b64decode(b64)
    assert len(struct.unpack(f"<{len(raw) // 4}f", raw)) == len(embeddings.data[0].embedding)
    # response_format: the schema's grammar (the demo model's JSON may be whitespace until max_tokens)
    structured = ChatCompletion.model_validate(by_id["json-1"]["response"]["body"])
    content = structured.choices[0].message.content
    assert content.strip() == "" or content.lstrip().startswith("{")
    if structured.choices[0].finish_reason == "stop":
        assert json.loads(content)["label"] in ("late", "broken")
    assert structured.choices[0].logprobs.content and len(structured.choices[0].logprobs.content[0].top_logprobs) <= 2
    compact = ChatCompletion.model_validate(by_id["json-2"]["response"]["body"])  # vLLM's extra field
    assert compact.choices[0].finish_reason == "stop"
    assert json.loads(compact.choices[0].message.content)["label"] in ("late", "broken")
    # Lines that are not requests: no response, an error object.
    not_json, no_id = outputs[6], outputs[7]
    assert not_json["response"] is None and not_json["error"]["code"] == "invalid_json"
    assert no_id["response"] is None and no_id["custom_id"] is None
    repeated = outputs[8]
    assert repeated["custom_id"] == "chat-1" and repeated["error"]["code"] == "duplicate_custom_id"
    # Bad requests: the status and error body a server gives.
    for custom_id, status, words in [("bad-url", 404, "url"), ("bad-model", 404, "gpt-4o"), ("bad-n", 400, "n=2"),
                                     ("bad-field", 400, "tools"), ("bad-temp", 400, "temperature"),
                                     ("too-long", 400, "context limit")]:
        response = by_id[custom_id]["response"]
        assert response["status_code"] == status and words in response["body"]["error"]["message"], custom_id
    # usage adds up, line by line, to the job's file
    bodies = [o["response"]["body"] for o in outputs if o["response"] and o["response"]["status_code"] == 200]
    assert usage["requests"] == len(outputs) and usage["failed_requests"] == len(outputs) - len(bodies)
    assert sum(b["usage"]["prompt_tokens"] for b in bodies) == usage["prompt_tokens"]
    assert sum(b["usage"].get("completion_tokens", 0) for b in bodies) == usage["completion_tokens"]


def test_a_killed_job_resumes_to_every_line_once_in_order(tmp_path):
    lines = [_line(f"t{i}", "/v1/completions", {"prompt": f"Ticket {i}: my order {i * 7} arrived late.",
                                                 "max_tokens": 24, "temperature": 0, "ignore_eos": True})
             for i in range(96)]
    source, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "batchgen_data.jobs.cli", "run-batch", "-i", str(source), "-o", str(output),
               "--rows-per-part", "16", *ENGINE_ARGS]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = tmp_path / "out.jsonl.parts" / "generate"
    try:
        deadline = time.monotonic() + 240
        while not list(parts.glob("part-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert list(parts.glob("part-*")), proc.stderr.read() if proc.poll() is not None else "no part in time"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not output.exists()
    assert main(["run-batch", "-i", str(source), "-o", str(output), "--rows-per-part", "16", *ENGINE_ARGS]) == 0
    resumed = [json.loads(line) for line in output.read_text().splitlines()]
    assert [o["custom_id"] for o in resumed] == [f"t{i}" for i in range(96)]
    assert all(o["response"]["status_code"] == 200 for o in resumed)
    fresh_output = tmp_path / "fresh.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(fresh_output), *ENGINE_ARGS]) == 0
    fresh = [json.loads(line) for line in fresh_output.read_text().splitlines()]
    assert [o["response"]["body"]["choices"] for o in resumed] == [o["response"]["body"]["choices"] for o in fresh]
    # a finished job's output is not written over without --overwrite
    assert main(["run-batch", "-i", str(source), "-o", str(output), *ENGINE_ARGS]) == 2


def test_run_writes_the_jobs_usage(tmp_path):
    rows = tmp_path / "in.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": f"Ticket {i}", "sampling_params": {"max_tokens": 3 + i}})
                              for i in range(5)) + "\n" + json.dumps({"prompt": ""}) + "\n")
    assert main(["run", str(rows), str(tmp_path / "out"), *ENGINE_ARGS]) == 0
    usage = json.loads((tmp_path / "out" / "_usage.json").read_text())
    assert usage["rows"] == 6 and usage["error_rows"] == 1
    assert usage["completion_tokens"] <= sum(3 + i for i in range(5)) and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
