"""chat_template and chat_template_kwargs reach the template in every entry point, and a
``messages`` value that is not a conversation is an error row."""

from __future__ import annotations

import json

import datasets
import pytest
from batchgen_data.operators.rows import StageConfig, prepare_rows

from batchgen_data import BatchGenMap, Engine, EngineConfig, SamplingParams
from batchgen_data.engine.tokenizer import ChatPrompt
from batchgen_data.errors import ConfigError
from batchgen_data.jobs.cli import main

# A template whose output depends on a keyword argument, as Qwen3's does on enable_thinking.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
)
CONVERSATION = [{"role": "user", "content": "Is the parcel late?"}]
KWARGS = {"enable_thinking": False}


@pytest.fixture(scope="module")
def lengths(demo_path):
    """Prompt lengths with the template alone and with the kwargs (the engine's own answer)."""
    with Engine(demo_path, EngineConfig(max_num_seqs=8)) as engine:
        params = SamplingParams(max_tokens=1, temperature=0)
        [plain] = engine.chat(CONVERSATION, params, chat_template=TEMPLATE)
        [thinking_off] = engine.chat(CONVERSATION, params, chat_template=TEMPLATE, chat_template_kwargs=KWARGS)
        decoded = engine.tokenizer.decode(thinking_off.prompt_token_ids, skip_special_tokens=False)
    assert "<think>" in decoded and thinking_off.num_input_tokens > plain.num_input_tokens
    return plain.num_input_tokens, thinking_off.num_input_tokens


def test_bad_messages_are_error_rows_naming_the_problem():
    columns = {"messages": ["Is the parcel late?", {"role": "user", "content": "hi"}, [{"role": "user"}], [],
                            ["hi", "there"], CONVERSATION]}
    rows = prepare_rows(columns, 6, StageConfig())
    assert "messages must be a list of {role, content} objects, got str" in rows[0].error
    assert "got dict" in rows[1].error
    assert "string 'role' and 'content'" in rows[2].error
    assert "must not be empty" in rows[3].error or "empty prompt" in rows[3].error
    assert "string 'role' and 'content'" in rows[4].error
    assert rows[5].error is None and rows[5].prompt == CONVERSATION


def test_stage_config_wraps_conversations_with_the_template_and_kwargs():
    rows = prepare_rows({"messages": [CONVERSATION]}, 1, StageConfig(chat_template=TEMPLATE, chat_template_kwargs=KWARGS))
    assert rows[0].prompt == ChatPrompt(CONVERSATION, TEMPLATE, KWARGS)
    with pytest.raises(ConfigError, match="chat_template_kwargs must be a dict"):
        StageConfig(chat_template_kwargs="enable_thinking=False")


def test_datasets_map_passes_the_kwargs(demo_path, lengths):
    # Arrow holds no column of lists and strings: such a column is JSON text (as the CLI stores it)
    ds = datasets.Dataset.from_list([{"messages": json.dumps(CONVERSATION)}, {"messages": json.dumps("not a conversation")}])
    fn = BatchGenMap(model=str(demo_path), engine_config={"max_num_seqs": 8}, max_tokens=1,
                     chat_template=TEMPLATE, chat_template_kwargs=KWARGS, json_columns=["messages"])
    out = ds.map(fn, batched=True, batch_size=2).to_list()
    assert out[0]["num_input_tokens"] == lengths[1]
    assert out[1]["finish_reason"] == "error" and "messages must be a list" in out[1]["__inference_error__"]


def test_cli_passes_the_kwargs(tmp_path, lengths):
    rows = [{"id": 0, "messages": CONVERSATION}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    for name, extra, expected in [("plain", [], lengths[0]),
                                  ("kwargs", ["--chat-template-kwargs", json.dumps(KWARGS)], lengths[1])]:
        out = tmp_path / name
        assert main(["run", str(tmp_path / "in.jsonl"), str(out), "--chat-template", str(tmp_path / "template.jinja"),
                     *extra, "--max-tokens", "1", "--max-num-seqs", "8", "--no-progress", "--output-format", "jsonl"]) == 0
        [row] = [json.loads(line) for p in out.glob("part-*") for line in p.read_text().splitlines()]
        assert row["num_input_tokens"] == expected
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "bad"), "--chat-template-kwargs", "[1]",
                 "--no-progress"]) == 2


def test_content_given_as_openai_text_parts_reads_as_text_and_media_parts_are_error_rows(demo_path):
    """``content`` as a list of parts (the OpenAI format Ray Data LLM's docs use) is its text
    parts joined; an image part is an error row saying multimodal input is not supported."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Is the parcel"}, {"type": "text", "text": "late?"}]}]
    joined = [{"role": "user", "content": "Is the parcel\nlate?"}]
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                          {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    prepared = prepare_rows({"messages": [parts, image]}, 2, StageConfig())
    assert prepared[0].error is None
    assert "multimodal input is not supported" in prepared[1].error and "image_url" in prepared[1].error
    with Engine(demo_path, EngineConfig(max_num_seqs=4)) as engine:
        params = SamplingParams(max_tokens=3, temperature=0)
        [from_parts], [from_text] = engine.chat(parts, params), engine.chat(joined, params)
        [bad] = engine.chat(image, params)
    assert from_parts.prompt_token_ids == from_text.prompt_token_ids and from_parts.token_ids == from_text.token_ids
    assert bad.finish_reason == "error" and "multimodal" in bad.error
