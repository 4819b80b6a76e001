"""The job manifest (``OUTPUT/_batchgen_job.json``): what makes a job this job.

A rerun into the same OUTPUT resumes only the same job: the same input files with the same bytes
(each file's SHA-256, computed while it is scanned), the same parts, and every option that changes
a row's result (the model and a fingerprint of its files, the prompt and chat templates, the
sampling defaults, constraints, the task, and the engine options that change tokens: device,
dtype, expert backend). A rerun that differs is refused, naming each difference; ``--overwrite``
starts the job over instead. Options that change how fast a job runs, not what it writes (workers,
batch sizes, prefix caching, speculative decoding, memory budgets), may change between runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchgen_data.errors import ConfigError
from batchgen_data.operators.rows import StageConfig

# StageConfig fields that do not change a row's result (json_columns is derived from the inputs,
# which the manifest records; the model is recorded with its fingerprint).
_NOT_RESULT_FIELDS = frozenset({"engine_config", "should_continue_on_error", "json_columns", "model",
                                "sampling_params"})
# EngineConfig fields that change tokens.
_RESULT_ENGINE_FIELDS = ("device", "dtype", "expert_backend")
_FINGERPRINT_BYTES = 1 << 20  # hashed from each end of a model file


@dataclass(slots=True)
class JobManifest:
    """What identifies a job: rerunning with a different one into the same OUTPUT is an error.

    ``skipped`` names the input files a ``--skip-bad-files`` run could not read. None of their
    parts is in OUTPUT, so a rerun reads them again, and may process them once fixed even if
    their bytes changed; ``columns`` (each column's type) makes sure such a rerun cannot add parts
    whose columns differ from the parts already there. ``options`` is None in a manifest written
    before options were recorded.
    """

    inputs: list[str]
    input_sizes: list[int]
    rows_per_part: int
    output_format: str
    encoding: str = "utf-8"
    skipped: list[str] = field(default_factory=list)
    columns: dict[str, str] | None = None
    input_sha256: list[str | None] | None = None
    options: dict[str, Any] | None = None

    @classmethod
    def read(cls, path: Path) -> JobManifest:
        try:
            values = json.loads(path.read_text())
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in values.items() if k in known})
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"{path} cannot be read as a job manifest ({err}); use a new OUTPUT folder, "
                              "delete it, or pass --overwrite") from None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def differences(self, previous: JobManifest) -> list[str]:
        """How this job differs from ``previous`` (empty: the same job)."""
        changes = []
        if self.inputs != previous.inputs:
            changes.append(f"input files {previous.inputs} then, {self.inputs} now")
        else:
            old_hashes = previous.input_sha256 or [None] * len(self.inputs)
            changed = [name for name, old_size, new_size, old, new in
                       zip(self.inputs, previous.input_sizes, self.input_sizes, old_hashes, self.input_sha256 or old_hashes)
                       if name not in previous.skipped and (old_size != new_size or (old and new and old != new))]
            if changed:
                changes.append(f"input files changed since: {changed}")
        for name in ("rows_per_part", "output_format", "encoding"):
            old, new = getattr(previous, name), getattr(self, name)
            if old != new:
                changes.append(f"{name} {old!r} then, {new!r} now")
        if previous.options is None:
            changes.append("the options of the job there were not recorded (an older batchgen-data wrote it)")
        elif self.options is not None:
            for key in sorted(set(previous.options) | set(self.options)):
                old, new = previous.options.get(key), self.options.get(key)
                if old != new:
                    changes.append(f"{key} {_short(old)} then, {_short(new)} now")
        return changes

    def check_same_job(self, previous: JobManifest, output: Path) -> None:
        changes = self.differences(previous)
        if changes:
            raise ConfigError(f"{output} holds parts of a different job ({'; '.join(changes)}); use a new "
                              "OUTPUT folder, or pass --overwrite to start this job over there")

    def check_same_columns(self, previous: JobManifest, output: Path) -> None:
        """After scanning the inputs: parts written now would have the columns of those there."""
        if previous.columns is None or self.columns == previous.columns or not any(output.glob("part-*")):
            return
        changed = sorted(k for k in {**previous.columns, **(self.columns or {})}
                         if previous.columns.get(k) != (self.columns or {}).get(k))
        raise ConfigError(f"{output} holds parts of a different job (the inputs now give other columns: {changed}, "
                          "e.g. a file skipped before reads now); use a new OUTPUT folder or pass --overwrite")


def job_options(stage: StageConfig) -> dict[str, Any]:
    """Every option of ``stage`` that changes a row's result, as JSON values."""
    options = {name: _plain(getattr(stage, name)) for name in StageConfig.__dataclass_fields__
               if name not in _NOT_RESULT_FIELDS}
    options.update(stage.sampling_params.to_dict())  # by field name, as a manifest has always held them
    options["model"] = stage.model
    options["model_fingerprint"] = model_fingerprint(stage.model)
    engine = stage.engine_config
    for name in _RESULT_ENGINE_FIELDS:
        value = getattr(engine, name, None) if engine is not None and not isinstance(engine, dict) else \
            (engine or {}).get(name)
        options[f"engine.{name}"] = _plain(value)
    return json.loads(json.dumps(options, default=str))


def model_fingerprint(model: str) -> str:
    """The demo's version, or a SHA-256 over a checkpoint folder's files: each one's name, size,
    and first and last MiB (config and tokenizer files whole; weights without reading gigabytes)."""
    if model == "demo":
        from batchgen_data.model.demo import DEMO_VERSION

        return f"demo-{DEMO_VERSION}"
    folder = Path(model)
    if not folder.is_dir():
        return "missing"  # the engine reports it when it loads
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                f.seek(size - _FINGERPRINT_BYTES)
                digest.update(f.read())
            elif size > _FINGERPRINT_BYTES:
                digest.update(f.read())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in asdict(value).items()}
    return value


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
