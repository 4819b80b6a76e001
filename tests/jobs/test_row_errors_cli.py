"""Through ``batchgen-data run`` (issue #50, findings 8 and 9): a row whose chat template loops
for ever or builds a huge text, a NaN or infinite sampling value, a regex beyond the grammar
library's limits and a 100,000-way choice each come out as their own row, an error row with a
one-line message where the row is bad, while the other rows generate; a non-finite sampling
flag stops the job before the model loads."""

from __future__ import annotations

import json
import math
import time

import pytest

from batchgen_data.jobs.cli import main

pytestmark = pytest.mark.timeout(120)  # without the per-row limit the looping row hangs the job

# Loops for ever on the row whose message says "loop", builds a 1 GB text on "huge" (small enough
# that a regression fails this test rather than the machine).
TEMPLATE = (
    "{%- if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{%- if messages[0].content == 'huge' %}{{ 'a' * 10 ** 9 }}{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
CHOICES = [f"c{i}" for i in range(100_000)]
ROWS = [
    {"id": 0, "messages": [{"role": "user", "content": "loop"}]},
    {"id": 1, "messages": [{"role": "user", "content": "Is the parcel late?"}]},
    {"id": 2, "messages": [{"role": "user", "content": "huge"}]},
    {"id": 3, "prompt": "Hello", "sampling_params": {"temperature": math.nan}},
    {"id": 4, "prompt": "Hello", "sampling_params": {"top_p": math.nan}},
    {"id": 5, "prompt": "Hello", "sampling_params": {"temperature": math.inf, "structured_outputs": {"choice": ["yes", "no"]}}},
    {"id": 6, "prompt": "Hello", "sampling_params": {"structured_outputs": {"regex": "a{1000000}"}}},
    {"id": 7, "prompt": "Pick one:", "sampling_params": {"max_tokens": 8, "structured_outputs": {"choice": CHOICES}}},
    {"id": 8, "prompt": "Hello"},
]
ERRORS = {
    0: "RequestError: chat template rendering took longer than 5.0 s (the per-row limit)",
    2: "RequestError: chat template rendering would build a text of 1,000,000,000 characters (the per-row limit is 16,000,000)",
    3: "RowError: invalid sampling_params: temperature must be a finite number, got nan",
    4: "RowError: invalid sampling_params: top_p must be a finite number, got nan",
    5: "RowError: invalid sampling_params: temperature must be a finite number, got inf",
    6: "RequestError: structured_outputs regex too large to compile: lexer error: too many expressions constructed",
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("row-errors")
    # Python's json writes NaN / Infinity, which the CLI reads as Python does.
    (folder / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (folder / "template.jinja").write_text(TEMPLATE)
    start = time.monotonic()
    code = main(["run", str(folder / "in.jsonl"), str(folder / "out"), "--chat-template", str(folder / "template.jinja"),
                 "--max-tokens", "4", "--max-num-seqs", "16", "--no-progress", "--output-format", "jsonl"])
    rows = [json.loads(line) for path in sorted((folder / "out").glob("part-*")) for line in path.read_text().splitlines()]
    return code, {row["id"]: row for row in rows}, time.monotonic() - start


def test_every_row_comes_out_and_the_job_succeeds(job):
    code, rows, seconds = job
    assert code == 0 and sorted(rows) == [row["id"] for row in ROWS]
    assert seconds < 60  # the looping row cost its 5 s, not the job


def test_bad_rows_are_one_line_error_rows_in_their_own_words(job):
    _, rows, _ = job
    for row_id, message in ERRORS.items():
        assert rows[row_id]["finish_reason"] == "error" and rows[row_id]["__inference_error__"] == message, row_id


def test_the_other_rows_generate(job):
    _, rows, _ = job
    for row_id in (1, 8):
        assert rows[row_id]["__inference_error__"] is None and rows[row_id]["num_generated_tokens"] == 4
    choice = rows[7]
    assert choice["__inference_error__"] is None and choice["finish_reason"] == "stop"
    assert choice["generated_text"] in set(CHOICES)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--temperature", "nan", "temperature must be a finite number, got nan"),
    ("--temperature", "inf", "temperature must be a finite number, got inf"),
    ("--top-p", "nan", "top_p must be a finite number, got nan"),
    ("--temperature", "1e300", "temperature must be within +-3.403e+38"),
])
def test_a_non_finite_sampling_flag_stops_the_job_before_the_model_loads(tmp_path, capsys, flag, value, message):
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    start = time.monotonic()
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), flag, value, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchgen-data: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and time.monotonic() - start < 5
