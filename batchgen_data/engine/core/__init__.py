"""The engine core, torch-free: sequence records and their lifecycle (``sequence.py``), the
inter-forward scheduler (``scheduler.py``: policy only), the KV manager over the block pool with
the prefix cache (``kv_manager.py``, ``block_pool.py``), what the scheduler and the model runner
say to each other (``runner_output.py``), the plain records a request crosses the executor seam in
(``request.py``: ``NewRequest`` in, ``FinishedRequest`` out) and what an engine publishes about
its requests (``progress.py``). Enforced by ``tests/test_import_floors.py``: importing any of it loads no torch.
"""
