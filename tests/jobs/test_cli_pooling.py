"""``batchgen-data run --task embed|classify``: every row's embedding (or class probabilities)
in a typed ``embeddings`` column of the Parquet parts, error rows with a null one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tiny_checkpoints import build_classifier_checkpoint

from batchgen_data import Engine, EngineConfig
from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.jobs.cli import build_parser, main

ENGINE_ARGS = ["--max-num-seqs", "32", "--no-progress", "--rows-per-part", "3"]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _parts(folder: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(folder.glob("part-*.parquet"))])


def test_embed_task_writes_an_embeddings_column(tmp_path, demo_path):
    rows = [{"id": i, "prompt": f"Ticket {i}: the parcel arrived {'late' if i % 2 else 'broken'}."} for i in range(6)]
    rows[3]["prompt"] = ""  # a bad row
    rows[4]["pooling_params"] = {"normalize": False}
    _write_jsonl(tmp_path / "in.jsonl", rows)
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--task", "embed", *ENGINE_ARGS]) == 0
    table = _parts(tmp_path / "out")
    assert table.schema.field("embeddings").type == pa.list_(pa.float32())
    got = {row["id"]: row for row in table.to_pylist()}
    engine = Engine(demo_path, EngineConfig(max_num_seqs=32))
    for row in rows:
        out = got[row["id"]]
        if row["id"] == 3:
            assert out["embeddings"] is None and "empty prompt" in out["__inference_error__"]
            continue
        params = PoolingParams(**row.get("pooling_params", {}))
        [expected] = engine.embed([row["prompt"]], params)
        assert out["__inference_error__"] is None and out["finish_reason"] == "stop"
        assert out["num_generated_tokens"] == 0 and out["generated_text"] == ""
        # Batched with other rows, a prompt's GEMMs may run on another kernel (the plan picks one per
        # row count), so the two agree to fp32 rounding (~3e-5 relative), not bit for bit.
        np.testing.assert_allclose(out["embeddings"], np.float32(expected.embeddings), rtol=1e-4, atol=1e-5)


def test_classify_task_writes_probabilities_and_needs_a_head(tmp_path, demo_path):
    build_classifier_checkpoint("qwen3_moe", tmp_path / "cls", num_labels=3)
    rows = [{"id": i, "prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(4)]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "--model", str(tmp_path / "cls"),
                 "--task", "classify", *ENGINE_ARGS]) == 0
    probs = _parts(tmp_path / "out").column("embeddings").to_pylist()
    assert all(len(p) == 3 and abs(sum(p) - 1) < 1e-5 for p in probs)
    assert main(["run", str(tmp_path / "in.jsonl"), str(tmp_path / "demo-out"), "--task", "classify",
                 *ENGINE_ARGS]) == 0  # bad rows are data: every row names the missing head
    errors = _parts(tmp_path / "demo-out").column("__inference_error__").to_pylist()
    assert all("sequence-classification head" in e for e in errors)


def test_task_flag_is_documented_and_checked(capsys):
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--task {generate,embed,classify}" in help_text
    try:
        main(["run", "in", "out", "--task", "score"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "invalid choice: 'score'" in capsys.readouterr().err
