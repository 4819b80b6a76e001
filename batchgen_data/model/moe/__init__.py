"""The MoE block's parts: routers, the expert contract, where experts live, expert backends.

Owns: ``router.py`` (each architecture's routing semantics), ``experts.py`` (stacked expert
weights, activation, the backend protocol), ``store.py`` (the ``ExpertStore`` contract: which
experts this process owns and their weights; the ``StreamedStore`` protocol),
``streamed_store.py`` (a bounded pool of expert slots filled from a slower tier) and its parts:
``slot_pool.py`` (the slots and what each holds), ``eviction.py`` (which slot gives way),
``prefetch.py`` (which experts a layer will ask for next), ``fetcher.py`` (the copy thread),
``stream_stats.py`` (its counters); ``native_backend.py`` and ``deepspeed_backend.py``
(backends reading weights only through a store), ``backends.py`` (choice by name).
May import: ``batchgen_data.model`` building blocks (layers, config), errors.
"""
