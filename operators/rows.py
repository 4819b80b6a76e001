"""Row bookkeeping shared by every pipeline stage: rows in, requests out, one output row per row.

The stage validates each row, tags it with its index in the batch, routes invalid rows to error
rows, runs the valid ones through the engine, and restores input order. A bad row is data: any
value the row layer cannot turn into a request (the wrong type, an empty prompt, a string holding
a lone surrogate, invalid sampling params) makes that row an error row naming the problem, never
a failed batch. The output columns are ``columns.py``'s.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, fields, replace
from typing import Any

from batchgen_data.config import EngineConfig
from batchgen_data.config.tasks import POOLING_TASKS, TASK_TYPES
from batchgen_data.engine.pooling_params import PoolingParams
from batchgen_data.engine.sampling_params import GUIDED_DECODING_ALIAS, SamplingParams, normalize_structured_outputs
from batchgen_data.engine.structured.params import StructuredOutputsParams
from batchgen_data.engine.tokenizer import ChatPrompt, check_messages
from batchgen_data.operators.columns import RowResult
from batchgen_data.operators.json_column import bound_to_column
from batchgen_data.operators.surrogates import find_lone_surrogate
from batchgen_data.errors import BatchGenError, ConfigError, error_text

# A row's prompt, in Ray Data LLM's order: ``messages`` render through the chat template and
# replace ``prompt`` (Ray's chat-template stage overwrites it), and token ids given as
# ``tokenized_prompt`` (Ray's name) or ``prompt_token_ids`` (vLLM's) are what the engine runs.
PROMPT_COLUMNS = ("messages", "tokenized_prompt", "prompt_token_ids", "prompt")
SAMPLING_PARAMS_COLUMN = "sampling_params"
# What a stage runs (Ray Data LLM's ``task_type``); the pooling ones read a row's
# ``pooling_params`` (Ray's column) instead of its ``sampling_params``.
POOLING_PARAMS_COLUMN = "pooling_params"
# A reader's reason to reject a row (an unparseable line, invalid bytes): the row becomes an
# error row with this message, and the column is not passed through (it would repeat the error).
INPUT_ERROR_COLUMN = "__input_error__"
# The stages' sampling defaults: vLLM's (``SamplingParams``), except that a batch job samples
# greedily unless told otherwise, so rerunning it gives the same outputs.
STAGE_SAMPLING_DEFAULTS = {**SamplingParams.defaults(), "temperature": 0.0}
# StageConfig fields holding text for the engine (a lone surrogate in one is a config error).
_TEXT_FIELDS = ("prompt_template", "chat_template", "chat_template_kwargs")
# Fields that hold ints (pandas hands nullable ints inside structs over as floats).
_INT_FIELDS = frozenset(
    name
    for name, hint in typing.get_type_hints(SamplingParams).items()
    if name in STAGE_SAMPLING_DEFAULTS and (hint is int or int in typing.get_args(hint))
)


@dataclass(slots=True)
class StageConfig:
    """What every pipeline stage (Ray Data, datasets, CLI) is configured with.

    Args:
        model (str, default "demo"): ``"demo"`` or a local checkpoint folder.
        engine_config (EngineConfig | dict | None): engine settings (a dict of its fields is fine).
        prompt_column (str | None, default None): read prompts from this column instead of the
            first of ``messages`` / ``tokenized_prompt`` / ``prompt_token_ids`` / ``prompt`` a row
            has (Ray Data LLM's precedence).
        prompt_template (str | None, default None): build each row's prompt with
            ``prompt_template.format(**row)`` (``{column}`` placeholders) instead.
        should_continue_on_error (bool, default True): a bad row becomes an error row; False
            raises instead.
        sampling_params (SamplingParams | dict | None, default None): the sampling params of rows
            without their own ``sampling_params``. A dict (vLLM's names) or None starts from
            ``STAGE_SAMPLING_DEFAULTS``: vLLM's defaults (``max_tokens`` 16, ``top_p`` 1.0, ...)
            except ``temperature``, 0 (greedy) here; a ``SamplingParams`` is taken as it is.
            Held as a ``SamplingParams`` (built and checked once, here).
            A ``structured_outputs`` JSON schema for an object also adds the typed
            ``generated_json`` column (see ``json_column.py``), and its grammar then allows only
            values the column holds (``json_column.bound_to_column``: integers within int64);
            a row's own ``structured_outputs`` or ``guided_decoding`` replaces the default.
            ``StageConfig.from_kwargs`` takes these as flat keywords (``max_tokens=64``), as the
            stages' constructors do.
        chat_template (str | None, default None): a Jinja chat template replacing the
            tokenizer's, for ``messages`` rows.
        chat_template_kwargs (dict | None, default None): passed to the chat template of
            ``messages`` rows (``{"enable_thinking": False}`` for Qwen3), as in vLLM and Ray Data LLM.
        json_columns (list[str] | None, default None): columns holding JSON text, decoded to
            Python values before validation. A reader stores a column this way when its values
            have no single Arrow type (a ``sampling_params`` that is a string in one row and an
            object in the next); each row is then validated on its real value. The columns pass
            through to the output as JSON text.
        apply_chat_template (bool, default True): False reads no ``messages`` column (Ray Data
            LLM's ``chat_template_stage`` disabled): a row's prompt is its ``tokenized_prompt``,
            ``prompt_token_ids`` or ``prompt``.
        detokenize_outputs (bool, default False): every row gets its ``generated_text``, even one
            whose ``sampling_params`` say ``detokenize=False`` (Ray Data LLM's detokenize stage
            decodes every row's tokens after the engine).
        task_type (str, default "generate"): Ray Data LLM's ``task_type``: ``"generate"``, or
            ``"embed"`` / ``"classify"`` (vLLM's pooling runner: each row runs prefill-only and
            its ``embeddings`` column holds the embedding or the class probabilities; a row's
            ``pooling_params`` dict, with ``vllm.PoolingParams`` names, replaces the defaults,
            and the sampling fields are not used).

    Example:
        >>> StageConfig.from_kwargs(model="demo", max_tokens=64).sampling_params.max_tokens
        64
    """

    model: str = "demo"
    engine_config: EngineConfig | dict | None = None
    prompt_column: str | None = None
    prompt_template: str | None = None
    should_continue_on_error: bool = True
    sampling_params: SamplingParams | dict | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    json_columns: list[str] | None = None
    apply_chat_template: bool = True
    detokenize_outputs: bool = False
    task_type: str = "generate"

    def __post_init__(self) -> None:
        if isinstance(self.engine_config, dict):
            self.engine_config = EngineConfig(**self.engine_config)
        if self.json_columns is not None:
            names = self.json_columns
            if isinstance(names, str) or not all(isinstance(c, str) for c in names):
                raise ConfigError(f"json_columns must be a list of column names, got {names!r}")
            self.json_columns = list(self.json_columns)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ConfigError(f"chat_template must be a string, got {type(self.chat_template).__name__}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError(f"chat_template_kwargs must be a dict, got {self.chat_template_kwargs!r}")
        for name in _TEXT_FIELDS:
            found = find_lone_surrogate(getattr(self, name))
            if found is not None:
                raise ConfigError(f"{found.describe(name)}: text must be valid Unicode")
        self.sampling_params = _stage_params(self.sampling_params, self.detokenize_outputs)
        if self.task_type not in TASK_TYPES:
            raise ConfigError(f"task_type must be one of {list(TASK_TYPES)}, got {self.task_type!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> StageConfig:
        """A config from flat keywords: ``SamplingParams`` names (``max_tokens=64``) go into
        ``sampling_params`` (over a ``sampling_params`` given too), the rest are this class's
        fields; an unknown name is a ``ConfigError``."""
        sampling_names = SamplingParams.defaults().keys() | {GUIDED_DECODING_ALIAS}
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in sampling_names}
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown stage option(s) {unknown}; options are StageConfig's fields "
                              f"and SamplingParams' names")
        if sampling:
            base = kwargs.get("sampling_params")
            base = base.to_dict() if isinstance(base, SamplingParams) else dict(base or {})
            kwargs["sampling_params"] = {**base, **sampling}
        return cls(**kwargs)

    def default_params(self) -> SamplingParams:
        """The params of a row without its own ``sampling_params``."""
        return self.sampling_params


def _stage_params(value: SamplingParams | dict | None, detokenize_outputs: bool) -> SamplingParams:
    """A stage's default params, built once: over ``STAGE_SAMPLING_DEFAULTS`` for a dict; with a
    JSON-object constraint bound to the ``generated_json`` column's types; ``detokenize`` on
    when every row's text is asked for."""
    if value is not None and not isinstance(value, (SamplingParams, dict)):
        raise ConfigError(f"sampling_params must be a SamplingParams, a dict or None, got {type(value).__name__}")
    found = find_lone_surrogate(value.to_dict() if isinstance(value, SamplingParams) else value)
    if found is not None:
        raise ConfigError(f"{found.describe()}: text must be valid Unicode")
    values = value.to_dict() if isinstance(value, SamplingParams) else {**STAGE_SAMPLING_DEFAULTS,
                                                                        **normalize_structured_outputs(value or {})}
    constraint = values.get("structured_outputs")
    if constraint is not None:
        constraint = StructuredOutputsParams.from_value(constraint)
        if constraint.object_schema is not None:  # a typed generated_json column: its grammar allows what it holds
            values["structured_outputs"] = replace(constraint, json=bound_to_column(constraint.object_schema))
    if detokenize_outputs:
        values["detokenize"] = True
    if isinstance(value, SamplingParams) and values == value.to_dict():
        return value
    return SamplingParams.from_dict(values)


@dataclass(slots=True)
class PreparedRow:
    """One input row: either a request for the engine or an error explaining why not."""

    index: int
    prompt: Any = None
    params: SamplingParams | PoolingParams | None = None
    error: str | None = None


class RowError(BatchGenError, ValueError):
    """A bad row, raised when ``should_continue_on_error=False``."""


def prepare_rows(columns: dict[str, list], num_rows: int, config: StageConfig) -> list[PreparedRow]:
    """Validate each row and build its prompt and sampling params (errors become data).

    A row with a reason in ``__input_error__`` (set by the reader) is an error row with that
    message. Without ``prompt_column``, each row reads the first of ``PROMPT_COLUMNS``
    (``messages``, ``tokenized_prompt``, ``prompt_token_ids``, ``prompt``) that it has (not
    null), so batches mixing rows of files with different prompt columns work.
    """
    defaults = config.default_params()
    input_errors = columns.get(INPUT_ERROR_COLUMN)
    if input_errors is None:
        input_errors = [None] * num_rows
    cells = _Cells(columns, config.json_columns)
    prompt_columns = None
    if config.prompt_template is None and any(_is_null(e) for e in input_errors):
        prompt_columns = _prompt_columns(columns, config)
    rows = []
    for i in range(num_rows):
        row = PreparedRow(index=i)
        try:
            if not _is_null(input_errors[i]):
                raise RowError(str(input_errors[i]))
            if prompt_columns is None:
                row.prompt = _format_prompt(config.prompt_template, cells, i)
            else:
                row.prompt = _read_prompt(*_first_prompt(cells, prompt_columns, i), config)
            if config.task_type == "generate":
                row.params = _row_params(cells.get(SAMPLING_PARAMS_COLUMN, i), defaults, config.detokenize_outputs)
            else:
                row.params = _row_pooling_params(cells.get(POOLING_PARAMS_COLUMN, i), config.task_type)
        except (BatchGenError, TypeError, ValueError) as err:
            row.prompt, row.params, row.error = None, None, error_text(err)
        rows.append(row)
    return rows


class _Cells:
    """Row values by column, with ``json_columns`` decoded from JSON text (a bad text is that
    row's error, not the batch's)."""

    def __init__(self, columns: dict[str, list], json_columns: list[str] | None):
        self.columns = columns
        self.json_columns = set(json_columns or ()) & set(columns)

    def names(self) -> list[str]:
        return list(self.columns)

    def get(self, name: str, index: int) -> Any:
        if name not in self.columns:
            return None
        value = self.columns[name][index]
        if name in self.json_columns and isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as err:
                raise RowError(
                    f"column {name!r} should hold JSON text but holds {value[:80]!r} ({err.msg})"
                ) from None
        return value


def _prompt_columns(columns: dict[str, list], config: StageConfig) -> list[str]:
    if config.prompt_column is not None:
        if config.prompt_column not in columns:
            raise ConfigError(
                f"prompt_column {config.prompt_column!r} not in the batch columns {sorted(columns)}"
            )
        return [config.prompt_column]
    present = [name for name in PROMPT_COLUMNS if name in columns
               and (config.apply_chat_template or name != "messages")]
    if not present:
        raise ConfigError(
            f"the batch has none of the prompt columns {list(PROMPT_COLUMNS)}; "
            f"columns: {sorted(columns)}"
        )
    return present


def _first_prompt(cells: _Cells, names: list[str], index: int) -> tuple[Any, str]:
    """The row's value in the first of ``names`` it has, and that column's name."""
    for name in names:
        value = _to_python(cells.get(name, index))
        if not _is_null(value):
            return value, name
    if len(names) > 1:
        raise RowError(f"missing prompt (columns {', '.join(repr(n) for n in names)} are all null)")
    return None, names[0]


def _format_prompt(template: str, cells: _Cells, index: int) -> str:
    values = {name: _to_python(cells.get(name, index)) for name in cells.names()}
    try:
        prompt = template.format(**values)
    except KeyError as err:
        raise RowError(
            f"prompt_template needs column {err.args[0]!r}, not in {sorted(values)}"
        ) from None
    except (AttributeError, IndexError, TypeError, ValueError) as err:  # {text.nope}, {text[9]}, {n:%}
        raise RowError(f"prompt_template could not be filled: {type(err).__name__}: {err}") from None
    if find_lone_surrogate(prompt) is not None:  # name the column it came from
        _check_text(values, "")
    if not prompt.strip():
        raise RowError("prompt_template produced an empty prompt")
    return prompt


def _read_prompt(value: Any, column: str, config: StageConfig) -> Any:
    value = _to_python(value)
    if _is_null(value):
        raise RowError(f"missing prompt (column {column!r} is null)")
    _check_text(value, column)
    is_chat = column == "messages" or (isinstance(value, list) and value and isinstance(value[0], dict))
    if is_chat:  # a conversation, never a raw prompt: a string here is an error, not a prompt
        try:
            check_messages(value)
        except BatchGenError as err:
            raise RowError(f"column {column!r}: {err}") from None
        if config.chat_template is None and config.chat_template_kwargs is None:
            return value
        return ChatPrompt(value, config.chat_template, config.chat_template_kwargs)
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"empty prompt in column {column!r}")
        return value
    if isinstance(value, list):
        if not value:
            raise RowError(f"empty prompt in column {column!r}")
        return value
    raise RowError(
        f"prompt in column {column!r} must be a string, token-id list or messages list, "
        f"got {type(value).__name__}"
    )


def _row_params(value: Any, defaults: SamplingParams, detokenize_outputs: bool = False) -> SamplingParams:
    value = _to_python(value)
    if _is_null(value):  # absent; pandas shows a missing struct as NaN: the stage's own (checked once)
        return defaults
    if not isinstance(value, dict):
        raise RowError(f"sampling_params must be a dict, got {type(value).__name__}")
    _check_text(value, SAMPLING_PARAMS_COLUMN)
    merged = defaults.to_dict()
    try:
        # Arrow structs give every key (null where a row did not set it): null means "default".
        # A NaN is a value, not a null (Arrow and pandas give a struct's null fields as None), and
        # SamplingParams refuses it as it refuses infinities.
        own = normalize_structured_outputs({k: _coerce(k, v) for k, v in value.items() if not _is_unset(v)})
        if isinstance(own.get("structured_outputs"), dict):
            # As Arrow hands a constraint over, a struct gives every field of the column (null
            # where this row has none): a JSON schema loses its null-valued keys (a schema
            # keyword is never null; ``"const": null`` is the one loss, and rare).
            own["structured_outputs"] = _drop_nulls(own["structured_outputs"])
        _take_n(own)
        merged.update(own)
        if detokenize_outputs:
            merged["detokenize"] = True
        return SamplingParams.from_dict(merged)
    except ConfigError as err:
        raise RowError(f"invalid sampling_params: {err}") from None


def _row_pooling_params(value: Any, task: str) -> PoolingParams:
    """A row's ``pooling_params`` (vLLM's names; absent or null: the defaults) for ``task``."""
    value = _to_python(value)
    if _is_null(value):
        return PoolingParams(task=task)
    if not isinstance(value, dict):
        raise RowError(f"pooling_params must be a dict, got {type(value).__name__}")
    try:
        # Arrow structs give every key (null where a row did not set it): null means "default".
        own = {k: int(v) if isinstance(v, float) and v.is_integer() else v  # pandas: nullable ints as floats
               for k, v in value.items() if not _is_null(v)}
        if own.get("task", task) != task:
            raise ConfigError(f"pooling_params task {own['task']!r} cannot run in a {task!r} stage")
        return PoolingParams.from_dict({**own, "task": task})  # built (and verified) once
    except ConfigError as err:
        raise RowError(f"invalid pooling_params: {err}") from None


def _take_n(own: dict) -> None:
    """vLLM's ``n`` (outputs per prompt), checked and taken out: Ray Data LLM's engine stage
    keeps the first of a row's ``n`` outputs, so that one alone is generated."""
    n = own.pop("n", 1)
    if isinstance(n, float) and n.is_integer():  # pandas hands nullable ints in structs as floats
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be an int >= 1, got {n!r}")


def _check_text(value: Any, column: str) -> None:
    """A string in ``value`` holding a lone surrogate (no tokenizer or Arrow column takes it)
    makes the row an error row naming where."""
    found = find_lone_surrogate(value)
    if found is not None:
        raise RowError(f"column {found.describe(column)}: text must be valid Unicode")


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if not _is_null(v)}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _is_null(value: Any) -> bool:
    """None, NaN, or pandas' NA / NaT (how pandas batches show missing values)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    return type(value).__name__ in ("NAType", "NaTType")


def _is_unset(value: Any) -> bool:
    """A field a row's struct leaves unset: None, or pandas' NA / NaT (a NaN is a value)."""
    return value is None or type(value).__name__ in ("NAType", "NaTType")


def _coerce(name: str, value: Any) -> Any:
    """pandas turns nullable ints inside structs into floats (3 -> 3.0): take integral ones back."""
    if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    if name in ("stop_token_ids", "allowed_token_ids") and isinstance(value, (list, tuple)):
        return [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
    if name == "logit_bias":
        if isinstance(value, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
            value = dict(value)  # an Arrow map column gives (key, value) pairs
        if isinstance(value, dict):  # an Arrow struct gives every key of the column, null where unset
            return {k: v for k, v in value.items() if not _is_null(v)}
    return value


def _to_python(value: Any) -> Any:
    """numpy / pyarrow scalars and arrays to plain Python (lists, dicts, str, int)."""
    if hasattr(value, "as_py"):
        return value.as_py()
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [_to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    return value


def check_errors(rows: list[PreparedRow], results: list[RowResult], config: StageConfig) -> None:
    """With ``should_continue_on_error=False``, the first bad row raises."""
    if config.should_continue_on_error:
        return
    for row, result in zip(rows, results):
        if result.error is not None:
            raise RowError(f"row {row.index} failed: {result.error}")
