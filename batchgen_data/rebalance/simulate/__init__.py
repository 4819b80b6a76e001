"""A discrete-event simulator of one rebalanced ``map_batches`` stage, for actor counts this
machine cannot run: ``python -m batchgen_data.rebalance.simulate SCENARIO.jsonl --actors N``.

It runs the real policy (``rebalance/core``: the work pool's leases and shares, the tail plan and
the move rule, the local-first rule, the worker's room) over modelled actors whose steps take
what the engine's step model says (``model.py``), with blocks handed out as Ray Data hands them
(``dispatch`` in ``run.py``). ``scenario.py`` reads the rows, ``actor.py`` is one modelled engine,
``bounds.py`` the lower bound a job cannot beat, ``cli.py`` the command. Pure Python: no torch,
no Ray.
"""
