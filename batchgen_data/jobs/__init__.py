"""Batch jobs over files: the ``batchgen-data`` CLI, job files and parts, outputs, progress.

Owns: ``cli.py`` (argument parsing, exit codes), ``runner.py`` (runs pending parts through one
local engine or Ray Data actors), ``inputs.py`` (input discovery, the check of every file before
the model loads, bad and skipped files), ``readers.py`` (one file as a table: pyarrow's fast
readers, decoding), ``tolerant_reader.py`` (line-by-line JSONL and CSV, bad lines as error rows),
``input_table.py`` (what both readers return), ``job_schema.py`` (one schema for every part),
``text_chunks.py`` (JSONL / CSV files cut into parts in one streaming pass), ``manifest.py`` (what makes a job this job), ``files.py``
(OUTPUT checks and lock, parts, atomic part files read back), ``progress.py``, ``sizes.py``
(byte sizes with units).
May import: everything below it (operators, distributed, engine, model, config, errors).
"""
