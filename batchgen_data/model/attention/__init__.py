"""Attention kinds, one file each, behind one contract (``spec.py``).

Owns: what a layer stores per token (``KVSpec``), the per-forward metadata that maps a flat token
batch onto paged KV (``metadata.py``), and each kind's prefill and decode over those pages
(``gqa.py``: grouped-query attention with RoPE, q/k norm and sliding windows).
May import: ``batchgen_data.model`` building blocks (config, layers, rope), errors.
"""
