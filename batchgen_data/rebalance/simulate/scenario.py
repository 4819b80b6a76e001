"""A scenario: the rows of one job in input order, as JSONL, one object per line:
``{"prompt_tokens": int, "output_tokens": int}``, optionally ``"max_tokens"`` (the row's budget,
at least ``output_tokens``; default ``output_tokens``: the row runs to its limit, as with
``ignore_eos``) and ``"prefix_id"`` (rows sharing a prompt prefix)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from batchgen_data.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Row:
    prompt_tokens: int
    output_tokens: int  # what it generates before it stops
    max_tokens: int  # its budget: what the pool plans with until lengths are learned
    prefix_id: int | None = None

    @property
    def prompt(self) -> str:
        """A stand-in prompt: rows of one ``prefix_id`` share their head (the pool's cache
        affinity reads it); others are unique."""
        return f"prefix {self.prefix_id}" if self.prefix_id is not None else ""


def row_of(values: dict, where: str = "row") -> Row:
    """One scenario row from its JSON object; a bad one is a ``ConfigError`` naming ``where``."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(values).__name__}")
    unknown = set(values) - {"prompt_tokens", "output_tokens", "max_tokens", "prefix_id"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    fields = {}
    for key, low in (("prompt_tokens", 0), ("output_tokens", 1), ("max_tokens", 1)):
        value = values.get(key, values.get("output_tokens") if key == "max_tokens" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{where}: {key} must be an int >= {low}, got {value!r}")
        fields[key] = value
    if fields["max_tokens"] < fields["output_tokens"]:
        raise ConfigError(f"{where}: max_tokens {fields['max_tokens']} is below output_tokens {fields['output_tokens']}")
    prefix = values.get("prefix_id")
    if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int)):
        raise ConfigError(f"{where}: prefix_id must be an int, got {prefix!r}")
    return Row(fields["prompt_tokens"], fields["output_tokens"], fields["max_tokens"], prefix)


def read_scenario(path: Path) -> list[Row]:
    """The rows of a scenario file (blank lines skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                values = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path.name}:{number}: not JSON ({err.msg})") from None
            rows.append(row_of(values, f"{path.name}:{number}"))
    if not rows:
        raise ConfigError(f"{path.name}: no rows")
    return rows


def write_scenario(path: Path, rows: Iterable[Row]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            values = {"prompt_tokens": row.prompt_tokens, "output_tokens": row.output_tokens}
            if row.max_tokens != row.output_tokens:
                values["max_tokens"] = row.max_tokens
            if row.prefix_id is not None:
                values["prefix_id"] = row.prefix_id
            f.write(json.dumps(values) + "\n")
