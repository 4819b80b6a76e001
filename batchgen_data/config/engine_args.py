"""vLLM's engine arguments (Ray Data LLM's ``engine_kwargs``) as this engine's ``EngineConfig``.

One table, ``ENGINE_ARGS``: every vLLM ``EngineArgs`` argument that Ray Data LLM's docs, examples
and tests use, each of one kind:

- MAPPED: same meaning here; the value lands in an ``EngineConfig`` field (``how`` says which).
- NO_OP: accepted, nothing to do here (``why`` says so); values that ask for something this
  engine cannot do are refused, naming what to use instead.
- REFUSED: a value other than vLLM's default is a ``ConfigError`` naming the argument and what
  to use instead; the default value is accepted.

Every ``EngineConfig`` field is also accepted under its own name. ``to_engine_config`` applies the
table; ``render_markdown`` renders it as ``docs/engine-kwargs.md`` (regenerate with
``python -m batchgen_data.config.engine_args > docs/engine-kwargs.md``; a test keeps them equal).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen_data.config import EngineConfig
from batchgen_data.errors import ConfigError

GIB = 1 << 30  # vLLM gives swap_space in GiB
# vLLM's dtype names -> EngineConfig's ("auto": fp32 on CPU, bf16 on CUDA, not the checkpoint's)
_DTYPE_ALIASES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                  "bf16": "bfloat16", "float": "float32", "float32": "float32"}
_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))

# (value, every engine_kwarg, model_source) -> the EngineConfig fields it sets; raises ConfigError
Apply = Callable[[Any, dict, "str | None"], dict]


class Kind(enum.Enum):
    MAPPED = "mapped"
    NO_OP = "no-op"
    REFUSED = "refused"


@dataclass(slots=True, frozen=True)
class EngineArg:
    """One vLLM engine argument: its ``kind``, ``how`` it maps here, ``why``, and ``apply``."""

    name: str
    kind: Kind
    how: str
    why: str
    apply: Apply


def _default(field_name: str) -> Any:
    return EngineConfig.__dataclass_fields__[field_name].default


def _refuse(name: str, value: Any, instead: str) -> ConfigError:
    return ConfigError(f"engine_kwargs {name}={value!r} is not supported here; {instead}")


def _same(field_name: str, convert: Callable[[Any], Any] = lambda v: v) -> Apply:
    """vLLM's value (None: the default) is this field's."""
    return lambda value, kwargs, model: {} if value is None else {field_name: convert(value)}


def _ignore(value: Any, kwargs: dict, model: str | None) -> dict:
    return {}


def _only(name: str, accepted: tuple, instead: str) -> Apply:
    """The values in ``accepted`` change nothing here; any other is refused."""
    def apply(value, kwargs, model):
        if value in accepted:
            return {}
        raise _refuse(name, value, instead)
    return apply


def _dtype(value: Any, kwargs: dict, model: str | None) -> dict:
    if value not in _DTYPE_ALIASES:
        raise ConfigError(f"engine_kwargs dtype={value!r} is not one of {sorted(_DTYPE_ALIASES)}")
    return {"dtype": _DTYPE_ALIASES[value]}


def _parallel(name: str) -> Apply:
    """tensor/data parallel ranks: with ``enable_expert_parallel`` they are vLLM's expert-parallel
    group (its size is tensor_parallel_size * data_parallel_size); otherwise only 1 is accepted."""
    def apply(value, kwargs, model):
        if value in (None, 1):
            return {}
        if kwargs.get("enable_expert_parallel"):
            return _expert_parallel(True, kwargs, model)
        raise _refuse(name, value, "use expert_parallel_size=N (experts spread over N ranks, each running its own "
                                   "sequences) or concurrency (engine actors)")
    return apply


def _executor_backend(value: Any, kwargs: dict, model: str | None) -> dict:
    """vLLM's backends: ``mp`` and ``ray`` start the expert-parallel ranks (with one rank there
    is nothing to start: no-op); ``uni`` and ``external_launcher`` (one process) are refused
    only where there are ranks."""
    if value in (None, "mp", "ray"):
        return {"distributed_executor_backend": value} if value and _ranks(kwargs) > 1 else {}
    if value in ("uni", "external_launcher"):
        if _ranks(kwargs) > 1:
            raise ConfigError(f"distributed_executor_backend={value!r} runs one process, but this engine has "
                              f"{_ranks(kwargs)} expert-parallel ranks: use 'mp' (local processes) or 'ray' (Ray actors)")
        return {}
    raise ConfigError(f"distributed_executor_backend={value!r}: use 'mp' (ranks as local processes) or 'ray' "
                      "(ranks as Ray actors in a placement group)")


def _expert_parallel(value: Any, kwargs: dict, model: str | None) -> dict:
    num_ranks = (kwargs.get("tensor_parallel_size") or 1) * (kwargs.get("data_parallel_size") or 1)
    return {"expert_parallel_size": num_ranks} if value and num_ranks > 1 else {}


def _ranks(kwargs: dict) -> int:
    """The expert-parallel ranks these kwargs ask for (vLLM's names or ours)."""
    if kwargs.get("expert_parallel_size"):
        return kwargs["expert_parallel_size"]
    return _expert_parallel(kwargs.get("enable_expert_parallel"), kwargs, None).get("expert_parallel_size", 1)


def _chunked_prefill(value: Any, kwargs: dict, model: str | None) -> dict:
    """False: a prompt runs whole in one step; the token budget holds ``max_model_len``."""
    if value is None:
        return {}
    max_model_len, budget = kwargs.get("max_model_len"), kwargs.get("max_num_batched_tokens")
    if value is False and max_model_len is not None and budget is not None and budget < max_model_len:
        raise ConfigError(f"engine_kwargs max_num_batched_tokens ({budget}) is smaller than max_model_len "
                          f"({max_model_len}) with enable_chunked_prefill=False: raise it, or allow chunking")
    return {"enable_chunked_prefill": bool(value)}


def _fraction(name: str, field_name: str) -> Apply:
    def apply(value, kwargs, model):
        if value is None:
            return {}
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"engine_kwargs {name} must be in (0, 1], got {value!r}")
        return {field_name: float(value)}
    return apply


def _tokenizer(value: Any, kwargs: dict, model: str | None) -> dict:
    if value is None or value == model:
        return {}
    raise _refuse("tokenizer", value, "the tokenizer loads from the model folder: put its tokenizer files in "
                                      "model_source")


def _swap_gib(value: Any) -> int:
    return int(value * GIB)


_LOCAL = "download the checkpoint (that revision) to a local folder and give it as model_source"
_M, _N, _R = Kind.MAPPED, Kind.NO_OP, Kind.REFUSED
ENGINE_ARGS: tuple[EngineArg, ...] = (
    # MAPPED: same meaning here
    EngineArg("max_model_len", _M, "`max_model_len`", "context limit; None: the checkpoint's",
              _same("max_model_len")),
    EngineArg("max_num_seqs", _M, "`max_num_seqs`", "sequences in the running set", _same("max_num_seqs")),
    EngineArg("max_num_batched_tokens", _M, "`max_num_batched_tokens`", "tokens per forward",
              _same("max_num_batched_tokens")),
    EngineArg("enable_prefix_caching", _M, "`enable_prefix_caching`", "automatic prefix caching, as vLLM's",
              _same("enable_prefix_caching")),
    EngineArg("prefix_caching_hash_algo", _M, "`prefix_caching_hash_algo`",
              "values in `config.PREFIX_CACHING_HASH_ALGOS`", _same("prefix_caching_hash_algo")),
    EngineArg("dtype", _M, "`dtype`: auto, half/float16, bfloat16/bf16, float/float32",
              "`auto` is fp32 on CPU and bf16 on CUDA, not the checkpoint's dtype", _dtype),
    EngineArg("seed", _M, "`seed`", "seeds requests that bring no seed of their own; None: 0", _same("seed")),
    EngineArg("block_size", _M, "`block_size`", "tokens per KV page", _same("block_size")),
    EngineArg("swap_space", _M, "`swap_space_bytes` = GiB * 2**30",
              "host pool for the KV of suspended sequences (resume by restoring, not recomputing)",
              _same("swap_space_bytes", _swap_gib)),
    EngineArg("enable_chunked_prefill", _M, "`enable_chunked_prefill`", "False: a prompt runs whole in one step "
              "or waits (first come, first served), and the step's token budget is raised to max_model_len, as "
              "vLLM's", _chunked_prefill),
    EngineArg("enable_expert_parallel", _M, "`expert_parallel_size` = tensor_parallel_size * data_parallel_size",
              "vLLM's expert-parallel group; here each rank also runs its own sequences (no tensor-parallel "
              "attention)", _expert_parallel),
    EngineArg("gpu_memory_utilization", _M, "`memory_utilization`, in (0, 1]", "the share of device memory "
              "(GPU memory; RAM on CPU) for weights + KV: the KV pool is at most that share less the weights, and "
              "not grown past what the running set needs", _fraction("gpu_memory_utilization", "memory_utilization")),
    EngineArg("speculative_config", _M, "`speculative_config`: method ngram, suffix or mtp, "
              "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, suffix_decoding_*", "drafts change no "
              "token, greedy or seeded; 0..k draft tokens per row each step, from its acceptance and measured step "
              "times (mtp: the checkpoint's MTP layer; eagle and draft models are refused)",
              _same("speculative_config")),
    # NO_OP: accepted, nothing to do here
    EngineArg("enforce_eager", _N, "-", "no CUDA graphs are captured; every step runs eagerly", _ignore),
    EngineArg("max_seq_len_to_capture", _N, "-", "no CUDA graphs are captured", _ignore),
    EngineArg("compilation_config", _N, "-", "nothing is compiled with torch.compile", _ignore),
    EngineArg("disable_log_stats", _N, "-", "stats are read with `Engine.stats()`, not logged", _ignore),
    EngineArg("disable_log_requests", _N, "-", "requests are not logged", _ignore),
    EngineArg("enable_log_requests", _N, "-", "requests are not logged", _ignore),
    EngineArg("distributed_executor_backend", _M, "`distributed_executor_backend`: mp, ray (uni, "
              "external_launcher: accepted with one rank)", "how expert-parallel ranks start: `mp` local "
              "processes, `ray` Ray actors in one placement group (default: Ray when it is initialized)",
              _executor_backend),
    EngineArg("trust_remote_code", _N, "-", "checkpoints load with this package's model code; no remote code runs",
              _ignore),
    EngineArg("tokenizer_mode", _N, "auto, hf", "the model folder's tokenizer loads with transformers' "
              "AutoTokenizer (its fast tokenizer); slow, mistral and custom are refused",
              _only("tokenizer_mode", (None, "auto", "hf"), "use tokenizer_mode='auto' (the model folder's fast "
                    "tokenizer; slow and mistral tokenizers are not loaded)")),
    EngineArg("tokenizer", _N, "None or model_source", "the tokenizer loads from the model folder", _tokenizer),
    EngineArg("load_format", _N, "auto, safetensors", "checkpoints load from safetensors; other formats "
              "(runai_streamer, gguf, ...) are refused", _only("load_format", ("auto", "safetensors"), _LOCAL)),
    EngineArg("model", _N, "-", "Ray Data LLM's engine stage replaces it with `model_source`", _ignore),
    EngineArg("guided_decoding_backend", _N, "-", "grammars come from llguidance (docs/structured-outputs.md)",
              _ignore),
    EngineArg("structured_outputs_config", _N, "-", "grammars come from llguidance (docs/structured-outputs.md)",
              _ignore),
    EngineArg("max_loras", _N, "-", "read only with enable_lora=True, which is refused", _ignore),
    EngineArg("max_lora_rank", _N, "-", "read only with enable_lora=True, which is refused", _ignore),
    EngineArg("max_cpu_loras", _N, "-", "read only with enable_lora=True, which is refused", _ignore),
    # REFUSED: anything but vLLM's default
    EngineArg("tensor_parallel_size", _R, "1; with enable_expert_parallel, see there", "attention and dense "
              "weights are not split", _parallel("tensor_parallel_size")),
    EngineArg("data_parallel_size", _R, "1; with enable_expert_parallel, see there", "engine replicas are "
              "`concurrency` (Ray actors)", _parallel("data_parallel_size")),
    EngineArg("pipeline_parallel_size", _R, "1", "layers are not split into stages",
              _only("pipeline_parallel_size", (None, 1), "use expert_parallel_size=N (experts spread over N "
                    "ranks) or weight_memory_bytes (experts stream from the checkpoint)")),
    EngineArg("enable_lora", _R, "False", "no LoRA adapters", _only("enable_lora", (None, False),
              "merge the adapter into the checkpoint and give that folder as model_source")),
    EngineArg("quantization", _R, "None", "weights run in `dtype`", _only("quantization", (None,),
              "give a float32/bfloat16/float16 checkpoint")),
    EngineArg("kv_cache_dtype", _R, "auto", "KV is stored in the model's dtype",
              _only("kv_cache_dtype", ("auto",), "use kv_cache_dtype='auto' (the model's dtype)")),
    EngineArg("cpu_offload_gb", _R, "0", "weights are budgeted by what stays resident",
              _only("cpu_offload_gb", (None, 0), "use weight_memory_bytes (routed experts stream from the "
                    "checkpoint)")),
    EngineArg("kv_transfer_config", _R, "None", "no disaggregated prefill",
              _only("kv_transfer_config", (None,), "drop it (no disaggregated prefill)")),
    EngineArg("limit_mm_per_prompt", _R, "None or {}", "text-only models", _only("limit_mm_per_prompt", (None, {}),
              "use a text-only model (multimodal inputs are not supported)")),
    EngineArg("mm_processor_kwargs", _R, "None or {}", "text-only models", _only("mm_processor_kwargs", (None, {}),
              "use a text-only model (multimodal inputs are not supported)")),
    EngineArg("task", _R, "generate, auto", "the task is the processor config's `task_type` (generate, embed, "
              "classify)", _only("task", (None, "generate", "auto"), "set task_type='embed' or 'classify' on the "
              "processor config (vLLMEngineProcessorConfig); scoring is not supported")),
    EngineArg("revision", _R, "None", "model_source is a local folder", _only("revision", (None,), _LOCAL)),
    EngineArg("tokenizer_revision", _R, "None", "model_source is a local folder",
              _only("tokenizer_revision", (None,), _LOCAL)),
)
BY_NAME = {arg.name: arg for arg in ENGINE_ARGS}


def engine_config_fields(engine_kwargs: dict, model_source: str | None = None) -> dict:
    """The ``EngineConfig`` fields ``engine_kwargs`` (vLLM's names or ``EngineConfig``'s) set.

    Raises ``ConfigError`` for an unknown key (listing the known ones), a refused value (naming
    what to use instead), or two keys that set one field to different values.
    """
    if not isinstance(engine_kwargs, dict):
        raise ConfigError(f"engine_kwargs must be a dict, got {type(engine_kwargs).__name__}")
    unknown = sorted(k for k in engine_kwargs if k not in BY_NAME and k not in _ENGINE_FIELDS)
    if unknown:
        raise ConfigError(f"unknown engine_kwargs {unknown}; known: vLLM's {sorted(BY_NAME)} and EngineConfig's "
                          f"{sorted(_ENGINE_FIELDS)} (docs/engine-kwargs.md)")
    fields: dict = {}
    set_by: dict[str, str] = {}
    for name, value in engine_kwargs.items():
        arg = BY_NAME.get(name)
        updates = arg.apply(value, engine_kwargs, model_source) if arg else {name: value}
        for field_name, field_value in updates.items():
            if field_name in fields and fields[field_name] != field_value:
                raise ConfigError(f"engine_kwargs {set_by[field_name]} and {name} set {field_name} to "
                                  f"{fields[field_name]!r} and {field_value!r}: give one")
            fields[field_name] = field_value
            set_by[field_name] = name
    return fields


def to_engine_config(engine_kwargs: dict, model_source: str | None = None) -> EngineConfig:
    """The ``EngineConfig`` for Ray Data LLM's ``engine_kwargs`` (vLLM's engine arguments).

    Args:
        engine_kwargs (dict): vLLM ``EngineArgs`` names (``ENGINE_ARGS``) or ``EngineConfig`` fields.
        model_source (str | None, default None): the model folder; a ``tokenizer`` equal to it is
            accepted.

    Example:
        >>> to_engine_config({"dtype": "half", "swap_space": 1, "enforce_eager": True}).swap_space_bytes
        1073741824
    """
    return EngineConfig(**engine_config_fields(engine_kwargs, model_source))


def render_markdown() -> str:
    """``docs/engine-kwargs.md``: the table, by kind."""
    lines = ["# `engine_kwargs`: vLLM's engine arguments here", "",
             "<!-- Generated by `python -m batchgen_data.config.engine_args > docs/engine-kwargs.md`; do not edit. -->", "",
             "`BatchGenProcessorConfig` (Ray Data LLM's `vLLMEngineProcessorConfig`) accepts any `engine_kwargs` "
             "when declared, as Ray's does; `build_processor` checks them. Every `EngineConfig` field is also "
             "accepted under its own name. An unknown key is an error listing the known ones.", "",
             "- **mapped**: same meaning here; the value lands in the `EngineConfig` field shown.",
             "- **no-op**: accepted; nothing to do here (a value shown as accepted changes nothing; others are "
             "refused).",
             "- **refused**: any value but the one shown is a `ConfigError` naming what to use instead.", "",
             "| argument | kind | here | why |", "|---|---|---|---|"]
    for kind in Kind:
        lines += [f"| `{a.name}` | {kind.value} | {a.how} | {a.why} |" for a in ENGINE_ARGS if a.kind is kind]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
