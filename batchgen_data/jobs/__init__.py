"""Batch jobs over files: the ``batchgen-data`` CLI, job files and parts, outputs, progress.

Owns: ``cli.py`` (argument parsing, exit codes), ``runner.py`` (runs pending parts through one
local engine or Ray Data actors), ``inputs.py`` (input discovery, the check of every file before
the model loads, bad and skipped files), ``readers.py`` (one file as a table: pyarrow's fast
readers, decoding), ``tolerant_reader.py`` (line-by-line JSONL and CSV, bad lines as error rows),
``input_table.py`` (what both readers return), ``job_schema.py`` (one schema for every part),
``files.py`` (OUTPUT checks, parts, atomic part files, the resume manifest), ``progress.py``, ``sizes.py``
(byte sizes with units).
May import: everything below it (operators, distributed, engine, model, config, errors).
"""
