"""Batch jobs over files: the ``batchgen-data`` CLI, job files and parts, outputs, progress.

Owns: ``cli.py`` (argument parsing, exit codes), ``runner.py`` (runs pending parts through one
local engine or Ray Data actors), ``files.py`` (input discovery, parts, atomic part files, the
resume manifest), ``progress.py``, ``sizes.py`` (byte sizes with units).
May import: everything below it (operators, distributed, engine, model, config, errors).
"""
