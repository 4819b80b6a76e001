"""OpenAI Batch files (the JSONL every batch service and ``vllm run-batch`` read) in and out:
``requests`` reads a line into rows, ``responses`` writes a line's response, ``run_batch`` runs
a file as ``run`` jobs, ``command`` is the ``run-batch`` subcommand."""
