"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict as a checked dataclass. No torch."""

from __future__ import annotations

from dataclasses import dataclass, fields

from batchgen_data.errors import ConfigError

# Methods built here (vLLM's "eagle" and draft models are not).
SPECULATIVE_METHODS = ("ngram", "suffix", "mtp")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Args (vLLM's names):
        method: ``"ngram"``: prompt lookup over the row's own prompt and output; ``"suffix"``:
            the job's finished outputs too (suffix decoding, ``proposers.SuffixProposer``);
            ``"mtp"``: the checkpoint's Multi-Token-Prediction layer (DeepSeek-V3, GLM-4.5:
            ``num_nextn_predict_layers``; ``model/mtp.py``).
        num_speculative_tokens: the most tokens a row drafts in one step (the policy picks
            0..this per row per step).
        prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix n-gram looked up
            in the row's own tokens.
        suffix_decoding_max_tree_depth: ``"suffix"``: the longest context whose continuations
            are counted (vLLM's default is 24; 8 here keeps the counts small).
        suffix_decoding_max_cached_requests: ``"suffix"``: finished outputs kept (vLLM: 10000;
            256 here: the counts grow with outputs x length x depth).
        suffix_decoding_min_token_prob: ``"suffix"``: a drafted token's least share of its
            context's continuations.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ConfigError(f"speculative_config suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig``, vLLM's dict form, or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config keys {unknown} are not supported here (known: {sorted(known)})")
        if "method" not in value:
            raise ConfigError("speculative_config needs a method, e.g. {'method': 'ngram', 'num_speculative_tokens': 4}")
        return cls(**value)
