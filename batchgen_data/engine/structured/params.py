"""What a request's output must match: ``StructuredOutputsParams``, with vLLM's names. No torch.

Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object`` is set. Ray Data
LLM passes the same fields as ``sampling_params["guided_decoding"]``; ``from_value`` takes
that dict form, where unset fields may be present as ``None`` (an Arrow struct gives every
field of the column).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batchgen_data.errors import ConfigError

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Fields of vLLM's GuidedDecodingParams that choose among vLLM's own backends: accepted so a Ray
# Data LLM row works as it is. This engine has one grammar library, so any ``backend`` is it and
# ``disable_fallback`` holds by construction (there is nothing to fall back to).
_BACKEND_FIELDS = ("backend", "disable_fallback")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """A constraint on one request's output (``vllm.sampling_params.StructuredOutputsParams``).

    Args:
        json (dict | str | None): a JSON Schema (a dict, or its JSON text) the output must
            validate against.
        regex (str | None): a regular expression the whole output must match.
        choice (list[str] | None): the output is exactly one of these strings.
        grammar (str | None): an EBNF grammar (GBNF, as llama.cpp and vLLM write it, with a
            ``root`` rule; or Lark, with a ``start`` rule).
        json_object (bool | None): any JSON object.
        disable_any_whitespace (bool, default False): JSON with no whitespace between tokens
            (shorter outputs; what a small model should use).
        whitespace_pattern (str | None, default None): a regex for the whitespace JSON may hold
            between tokens (``" ?"``: at most one space), as vLLM's.
        disable_additional_properties (bool, default False): JSON objects whose schema does not
            say otherwise take no properties beyond the listed ones (``additionalProperties:
            false``), as vLLM's guidance backend.

    Example:
        >>> StructuredOutputsParams(choice=["positive", "negative"]).kind
        'choice'
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ConfigError(
                "structured_outputs needs exactly one of " + ", ".join(CONSTRAINT_KINDS)
                + (f"; got {len(set_kinds)}: {set_kinds}" if set_kinds else "; got none")
            )
        if self.json is not None:
            object.__setattr__(self, "json", parse_json_object(self.json, "structured_outputs json"))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ConfigError(f"structured_outputs regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            choice = list(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ConfigError(
                    f"structured_outputs choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ConfigError(f"structured_outputs grammar must be a non-empty string, got {self.grammar!r}")
        if self.json_object not in (None, True):
            raise ConfigError(f"structured_outputs json_object must be true when given, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"structured_outputs {name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ConfigError(f"structured_outputs whitespace_pattern must be a regex string, got "
                              f"{self.whitespace_pattern!r}")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise ConfigError("structured_outputs: give whitespace_pattern or disable_any_whitespace, not both")
        if (self.whitespace_pattern is not None or self.disable_additional_properties) and \
                self.kind not in ("json", "json_object"):
            raise ConfigError("structured_outputs whitespace_pattern and disable_additional_properties apply to "
                              f"json and json_object, not {self.kind}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``CONSTRAINT_KINDS``."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The constraint as canonical text: equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace, self.whitespace_pattern,
                           self.disable_additional_properties], sort_keys=True, default=list)

    @property
    def object_schema(self) -> dict | None:
        """The JSON schema when it describes an object with properties (what a typed column is
        built from), else None."""
        schema = self.json
        if isinstance(schema, dict) and schema.get("type") == "object" and isinstance(schema.get("properties"), dict):
            return schema
        return None

    def to_dict(self) -> dict:
        """The set fields as plain data (``from_value`` takes it back)."""
        out: dict[str, Any] = {self.kind: _plain(getattr(self, self.kind))}
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name):
                out[name] = True
        if self.whitespace_pattern is not None:
            out["whitespace_pattern"] = self.whitespace_pattern
        return out

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """From a ``StructuredOutputsParams`` or its dict form (vLLM's or Ray Data LLM's
        ``guided_decoding``); ``None`` values count as unset, unknown keys are an error."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"structured_outputs must be a dict or StructuredOutputsParams, got {type(value).__name__}")
        known = set(CONSTRAINT_KINDS) | {"disable_any_whitespace", "whitespace_pattern",
                                         "disable_additional_properties"}
        unknown = sorted(set(value) - known - set(_BACKEND_FIELDS))
        if unknown:
            raise ConfigError(f"unknown structured_outputs field(s) {unknown}; known: {sorted(known)}")
        fields = {k: v for k, v in value.items() if k in known and v is not None}
        return cls(**fields)


def parse_json_object(value: Any, what: str) -> dict:
    """``value`` (a dict, or JSON text holding an object) as a dict; a ``ConfigError`` naming
    ``what`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
