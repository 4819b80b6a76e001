"""Speculative decoding: a proposer guesses a row's next tokens, one forward checks them all.

``batchgen_data/config/speculative.py`` (``SpeculativeConfig``, vLLM's ``speculative_config``,
beside ``EngineConfig``), ``proposers.py`` (n-gram prompt lookup, suffix decoding over the
job's outputs, and tables of known tokens for benchmarks), ``policy.py`` (how many tokens each
row drafts this step, 0 included, from its acceptance and the measured step times), and
``drafter.py`` (the scheduler's side: drafts in, accepted tokens out). No torch.
"""
