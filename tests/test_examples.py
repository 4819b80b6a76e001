"""Every example runs on the demo model, and the four ways in agree row for row.

The Ray pipeline, the ``datasets`` map, the ETL notebook and the CLI job (the README's main
command) all generate greedily with the same ``max_tokens``, so each ticket must get the same
text from each of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbclient
import nbformat
import pyarrow.parquet as pq
import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES_DIR))  # the examples import each other as top-level modules

import datasets_map  # noqa: E402
import prompts  # noqa: E402
import quickstart  # noqa: E402
import ray_data_llm_switch  # noqa: E402
import ray_pipeline  # noqa: E402
import structured_triage  # noqa: E402

MAX_TOKENS = 16
TICKET_IDS = sorted(t["ticket_id"] for t in prompts.load_tickets())


@pytest.fixture(scope="module")
def ray_rows(ray_cluster, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("ray-out") / "tickets"
    ray_pipeline.main(str(output_dir), max_tokens=MAX_TOKENS)
    return pq.read_table(output_dir).to_pylist()


@pytest.fixture(scope="module")
def cli_rows(tmp_path_factory):
    from batchgen_data.jobs.cli import main

    out = tmp_path_factory.mktemp("cli-out") / "tickets"
    code = main(["run", str(EXAMPLES_DIR / "data" / "support_tickets.jsonl"), str(out),
                 "--prompt-template", str(EXAMPLES_DIR / "data" / "triage_prompt.txt"),
                 "--max-tokens", str(MAX_TOKENS), "--max-num-seqs", "32", "--no-progress"])
    assert code == 0
    rows = pq.read_table(out).to_pylist()
    for row in rows:
        row["prompt"] = prompts.build_prompt(row)  # the CLI builds prompts without storing them
    return rows


@pytest.fixture(scope="module")
def datasets_rows():
    return datasets_map.main(max_tokens=MAX_TOKENS).to_list()


@pytest.fixture(scope="module")
def notebook_rows(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("notebook-out")
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    # A kernelspec of our own, first on JUPYTER_PATH, so the kernel runs this interpreter even
    # when a user-level "python3" kernelspec points at another one.
    spec_dir = jupyter_dir / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": "Python 3", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    nb = nbformat.read(EXAMPLES_DIR / "etl_notebook.ipynb", as_version=4)
    with pytest.MonkeyPatch.context() as env:  # the kernel inherits this process's environment
        env.setenv("JUPYTER_PATH", str(jupyter_dir))
        env.setenv("BATCHGEN_NOTEBOOK_OUT", str(out_dir))
        env.setenv("BATCHGEN_NOTEBOOK_MAX_TOKENS", str(MAX_TOKENS))
        client = nbclient.NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(EXAMPLES_DIR)}},
        )
        client.execute()
    assert (out_dir / "tokens_and_time.png").stat().st_size > 0
    return pq.read_table(out_dir / "notebook_output.parquet").to_pylist()


def check_rows(rows: list[dict]) -> dict[int, dict]:
    """Every ticket exactly once, none failed; rows keyed by ticket_id."""
    assert sorted(r["ticket_id"] for r in rows) == TICKET_IDS
    for row in rows:
        assert row["__inference_error__"] is None, row
        assert row["finish_reason"] in ("length", "stop"), row
        assert row["generated_text"] is not None
        assert 0 < row["num_generated_tokens"] <= MAX_TOKENS
    return {r["ticket_id"]: r for r in rows}


def test_quickstart_runs(capsys):
    quickstart.main()
    assert capsys.readouterr().out.count("->") == 3


def test_parse_output_reads_the_reply_format_and_tolerates_gibberish():
    reply = "Category: Billing ; urgency: HIGH\n"
    assert prompts.parse_output(reply) == {"category": "billing", "urgency": "high"}
    assert prompts.parse_output("urgency: low") == {"category": None, "urgency": "low"}
    assert prompts.parse_output("พู warrants�机动车:") == {"category": None, "urgency": None}
    assert prompts.parse_output(None) == {"category": None, "urgency": None}


def test_datasets_map_example(datasets_rows):
    rows = check_rows(datasets_rows)
    ticket = prompts.load_tickets()[0]
    assert rows[ticket["ticket_id"]]["prompt"] == prompts.build_prompt(ticket)


@pytest.mark.timeout(300)
def test_ray_pipeline_example(ray_rows):
    check_rows(ray_rows)


def test_notebook_example(notebook_rows):
    check_rows(notebook_rows)


@pytest.mark.timeout(300)
def test_pipelines_agree_on_every_ticket(ray_rows, datasets_rows, notebook_rows, cli_rows):
    by_pipeline = {"ray": ray_rows, "datasets": datasets_rows, "notebook": notebook_rows, "cli": cli_rows}
    keyed = {name: check_rows(rows) for name, rows in by_pipeline.items()}
    for ticket_id in TICKET_IDS:
        expected = keyed["datasets"][ticket_id]
        for name in ("ray", "notebook", "cli"):
            row = keyed[name][ticket_id]
            assert row["prompt"] == expected["prompt"], (name, ticket_id)
            assert row["generated_text"] == expected["generated_text"], (name, ticket_id)
            assert list(row["generated_tokens"]) == list(expected["generated_tokens"]), name


def test_structured_triage_example_gives_labels_and_typed_columns():
    import jsonschema

    tickets = prompts.load_tickets()[:6]
    labels = structured_triage.classify(structured_triage.Engine("demo"), tickets)
    assert all(label in structured_triage.URGENCY for label in labels)
    table = structured_triage.extract(tickets)
    schema = json.loads((EXAMPLES_DIR / "data" / "triage_schema.json").read_text())
    assert set(table.features["generated_json"]) == set(schema["properties"])
    for row in table:
        assert row["finish_reason"] == "stop", row
        jsonschema.validate(row["generated_json"], schema)
        assert row["generated_json"] == json.loads(row["generated_text"])


@pytest.mark.timeout(300)
def test_ray_data_llm_switch_example(ray_cluster):
    rows = ray_data_llm_switch.main(num_rows=6)
    assert sorted(r["ticket_id"] for r in rows) == TICKET_IDS[:6]
    assert all(r["urgency"] in ray_data_llm_switch.URGENCY and 0 < r["confidence"] <= 1 for r in rows)
