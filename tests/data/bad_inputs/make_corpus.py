"""Writes the bad-input corpus next to this file: the kinds of files real data lakes hold.

    python tests/data/bad_inputs/make_corpus.py [FOLDER]

Hand-edited JSONL, exports with mixed types, Latin-1 and BOM-prefixed text, a Parquet part cut
short by a crashed writer, a folder mixing formats and writers' marker files. Each file is a few
rows; ``tests/jobs/test_bad_inputs.py`` runs the CLI over them. Rerun this after changing it and
commit the files.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _parquet(rows: list[dict], schema: pa.Schema | None = None) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buffer)
    return buffer.getvalue()


def _ticket(i: int) -> dict:
    return {"id": i, "prompt": f"Ticket {i}: my parcel {i * 7} arrived {'late' if i % 2 else 'damaged'}."}


def corpus() -> dict[str, bytes]:
    """Relative path -> file content."""
    files = {}
    # One malformed line (cut short) and one line that is JSON but not an object, among good
    # lines, with a blank line (not a row) in between: lines 3 and 6 are the bad ones.
    files["malformed_line.jsonl"] = _jsonl([
        _ticket(0), _ticket(1), b'{"id": 2, "prompt": "Ticket 2: where is', _ticket(3), b"",
        b'["not", "an", "object"]', _ticket(5),
    ])
    # Mixed types inside one column, one file per column named in issue #18.
    files["mixed_types/messages.jsonl"] = _jsonl([
        {"id": "m0", "messages": [{"role": "user", "content": "Is my order late?"}]},
        {"id": "m1", "messages": "A plain string where a messages list should be."},
        {"id": "m2", "messages": {"role": "user", "content": "one message, not a list"}},
        {"id": "m3", "messages": [{"role": "user", "content": "Thanks!"}]},
    ])
    files["mixed_types/token_ids.jsonl"] = _jsonl([
        {"id": "t0", "prompt_token_ids": [9707, 11, 1879]},
        {"id": "t1", "prompt_token_ids": [9707, "eleven", 1879]},
        {"id": "t2", "prompt_token_ids": [40, 1079]},
    ])
    files["mixed_types/sampling_params.jsonl"] = _jsonl([
        {"id": "s0", "prompt": "Summarise: the blender broke.", "sampling_params": {"max_tokens": 2}},
        {"id": "s1", "prompt": "Summarise: the kettle leaks.", "sampling_params": "max_tokens=2"},
        {"id": "s2", "prompt": "Summarise: the toaster is fine."},
    ])
    files["empty.jsonl"] = b""
    files["zero_rows.parquet"] = _parquet([], pa.schema([("id", pa.int64()), ("prompt", pa.string())]))
    whole = _parquet([_ticket(i) for i in range(20)])
    files["truncated.parquet"] = whole[: len(whole) // 2]
    # One non-UTF-8 byte (Latin-1 e-acute) in row 3 (line 4): only that row is an error.
    files["bad_byte.csv"] = (b"id,prompt\n0,Ticket 0: the lid is cracked.\n1,Ticket 1: no manual.\n"
                             b"2,Ticket 2: caf\xe9 machine leaks.\n3,Ticket 3: wrong colour.\n")
    files["latin1.csv"] = "id,prompt\n0,Ticket 0: the café machine leaks.\n1,Ticket 1: naïve question.\n".encode("latin-1")
    files["bom.jsonl"] = b"\xef\xbb\xbf" + _jsonl([_ticket(0), _ticket(1)])
    files["bom.csv"] = b"\xef\xbb\xbfid,prompt\n0,Ticket 0: hello.\n"
    files["duplicate_columns.csv"] = b"id,prompt,note,note\n0,Ticket 0: late.,first,second\n1,Ticket 1: broken.,third,fourth\n"
    # Line 3 has one field too many: an error row; the rest read as usual.
    files["wrong_field_count.csv"] = b"id,prompt\n0,Ticket 0: late.\n1,Ticket 1: broken,very\n2,Ticket 2: fine.\n"
    # A folder mixing formats and columns: `id` is a number in one file and text in the other,
    # `score` an integer and a float, and the prompts are in different columns.
    files["mixed_folder/a.parquet"] = _parquet([{**_ticket(i), "score": i} for i in range(3)])
    files["mixed_folder/b.jsonl"] = _jsonl([
        {"id": f"b{i}", "messages": [{"role": "user", "content": f"Question {i}?"}], "score": i + 0.5, "lang": "en"}
        for i in range(2)
    ])
    # Good files, unreadable ones, and writers' markers that are not input.
    files["folder_with_bad_files/good.jsonl"] = _jsonl([_ticket(i) for i in range(3)])
    files["folder_with_bad_files/broken.parquet"] = files["truncated.parquet"]
    files["folder_with_bad_files/notes.txt"] = b"not an input file\n"
    files["folder_with_bad_files/_SUCCESS"] = b""
    files["folder_with_bad_files/.part-0.parquet.crc"] = b"\x00\x01"
    return files


def main(folder: Path) -> None:
    for name in ("mixed_types", "mixed_folder", "folder_with_bad_files"):
        shutil.rmtree(folder / name, ignore_errors=True)
    for name, data in corpus().items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
