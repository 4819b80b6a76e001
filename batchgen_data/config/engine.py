"""Engine configuration: one slotted dataclass, validated with messages naming the bad value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen_data.config.speculative import SpeculativeConfig
from batchgen_data.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported only where a device or dtype is resolved: the scheduler and block accounting,
# which read this config, stay importable without torch.
_DTYPES = ("float32", "bfloat16", "float16")
SUSPEND_POLICIES = ("most_progress", "shortest_first")
# vLLM's ``prefix_caching_hash_algo`` values this engine implements (``engine/core/kv_manager.py``).
PREFIX_CACHING_HASH_ALGOS = ("sha256",)
RESUME_MODES = ("recompute", "swap")
# How expert-parallel ranks start (vLLM's ``distributed_executor_backend``; None: Ray when it is
# initialized here) and Ray's placement group strategies for Ray-placed ranks.
DISTRIBUTED_EXECUTOR_BACKENDS = (None, "mp", "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# How routed experts run (``model/moe/backends.py``): this package's kernels, or DeepSpeed-MoE's.
EXPERT_BACKENDS = ("native", "deepspeed")


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs. Every field has a default that works on a laptop CPU.

    Args:
        dtype (str, default "auto"): ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"``
            (fp32 on CPU, where bf16 matmul is ~8x slower; bf16 on CUDA).
        device (str, default "auto"): ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.
        expert_backend (str, default "native"): ``"native"`` or ``"deepspeed"``.
        max_num_seqs (int, default 256): B_moe, sequences in the running set; the router and
            experts of each layer run on all of their tokens at once.
        attention_batch_size (int, default 64): B_attn, sequences per attention micro-batch.
        max_num_batched_tokens (int, default 2048): tokens per forward (decode tokens plus
            prefill chunks); long prompts are prefilled in chunks so decoding never stalls.
        block_size (int, default 16): tokens per KV page.
        kv_cache_memory_bytes (int | None, default None): KV pool budget in bytes; None sizes it
            for ``max_num_seqs`` sequences of 1024 tokens (capped at 4 GiB).
        swap_space_bytes (int, default 0): host pool for the KV of suspended sequences (resume by
            restoring); 0 means suspended sequences are recomputed from their tokens.
        suspend_policy (str, default "most_progress"): which running sequences yield first when
            KV memory runs short: ``"most_progress"`` keeps the sequences nearest completion
            running and suspends the least advanced (the paper); ``"shortest_first"`` suspends
            the shortest sequences first (the reference code).
        refill_threshold (float, default 0.75): refill the running set (switch to prefill) when
            it falls below this fraction of ``max_num_seqs`` or the waiting work would fit.
        max_model_len (int | None, default None): context limit; None uses the checkpoint's.
        seed (int, default 0): seeds requests that bring no seed of their own.
        collect_timeline (bool, default False): record per-step stats for plots.
        tune_gemms (bool, default True): on CPU in fp32, measure which GEMM kernel is fastest
            for each of the model's weight shapes and row counts on this machine (once, ~2-4 s
            for a 200 M-parameter model; cached under the cache folder) instead of a fixed rule.
        expert_parallel_size (int, default 1): N > 1 spreads the experts over N rank processes
            on this node (spawned by the engine; gloo on CPU, NCCL with one GPU per rank on
            CUDA). Each rank loads only its E/N experts of every MoE layer and runs its own
            sequences (scheduler, KV pool of ``kv_cache_memory_bytes``, sampler); every MoE
            layer exchanges tokens by DeepSpeed-MoE all-to-all, all ranks in lockstep. The
            model's expert count must be divisible by N.
        rank_timeout_s (float, default 120): with expert parallelism, the longest a step or a
            collective may take before the ranks are declared dead (``EngineDeadError``).
        bind_rank_cpus (bool | None, default None): with expert parallelism on CPU, bind each
            rank to its own slice of the CPUs this process may use (rank r: CPUs
            ``r*t .. r*t+t-1``, t = threads per rank), so a rank woken from a collective does not
            wait for a core. None binds unless the engine runs inside a Ray worker, where
            several actors may share a node's CPUs; set False when several engines share them.
            Ray-placed ranks instead bind to the whole CPUs their bundles add up to on each
            machine, claimed from a machine-wide registry so no two groups take the same cores
            (unless False).
        distributed_executor_backend (str | None, default None): how the expert-parallel ranks
            start (vLLM's name): ``"mp"``, as child processes of this process on this node
            (rendezvous on the loopback address); ``"ray"``, as Ray actors placed by one
            placement group of N bundles, which may span machines (rank 0 publishes its node's
            address; ``docs/architecture.md``, "Expert parallelism"); None: ``"ray"`` when Ray is
            initialized in this process (a Ray Data actor, ``--workers``, ``--address``, a
            driver that called ``ray.init``), else ``"mp"``. With ``"ray"`` and Ray not yet
            initialized, ``ray.init()`` joins ``RAY_ADDRESS`` or starts a local Ray, as vLLM does.
        placement_strategy (str, default "PACK"): with Ray-placed ranks, the placement group's
            strategy: ``"PACK"`` (as few nodes as fit), ``"SPREAD"``, ``"STRICT_PACK"`` (one
            node) or ``"STRICT_SPREAD"`` (one rank per node). Ray Data LLM's
            ``placement_group_config["strategy"]`` sets it.
        rank_resources (dict | None, default None): with Ray-placed ranks, one rank's bundle,
            e.g. ``{"CPU": 4, "GPU": 1}`` (custom resources allowed); None: ``{"CPU": 1}``, plus
            ``{"GPU": 1}`` on CUDA. A rank runs ``max(1, int(CPU))`` torch threads. Ray Data
            LLM's ``placement_group_config["bundles"]`` sets it.
        weight_memory_bytes (int | None, default None): bytes the model's weights may take in
            memory (on a GPU, GPU memory); None keeps every weight resident. Otherwise the
            dense weights (attention, norms, routers, shared experts, dense layers, embeddings,
            lm_head) stay resident and the routed experts stream from the checkpoint's
            memory-mapped safetensors through a pool of what the budget leaves: models larger
            than memory run, with greedy tokens identical to a resident run. The engine then
            plans the running set (at most ``max_num_seqs``) with the fetch rate it measures at
            load (``stats().offload``). The budget must hold the dense weights plus one layer's
            top-k experts; the load error names that minimum. Not combinable with
            ``expert_parallel_size`` > 1.
        enable_chunked_prefill (bool, default True): a prompt longer than what is left of a
            step's token budget runs in chunks over several steps. False (vLLM's
            ``enable_chunked_prefill=False``): a prompt runs whole in one step or waits, and the
            token budget is raised to at least ``max_model_len``.
        memory_utilization (float | None, default None): vLLM's ``gpu_memory_utilization``: the
            share of the device's memory (GPU memory on CUDA, physical RAM on CPU) that weights
            plus the KV pool may take. The KV pool is then at most that share less the resident
            weights (never more than the running set needs: unlike vLLM, the pool is not grown to
            fill the share); a share the weights already fill is a ``ConfigError``. None: no cap.
        enable_prefix_caching (bool, default True): rows whose prompts share a prefix share its
            KV (vLLM's automatic prefix caching): every full KV block is named by a hash of its
            tokens and its prefix, freed blocks keep their KV until the space is needed (least
            recently freed first), and a new sequence starts after the longest prefix already
            cached. Waiting rows are admitted longest cached prefix first, and siblings wait one
            step for a shared prefix another row is computing. Tokens are the same either way.
        prefix_caching_hash_algo (str, default "sha256"): how a KV block is named in the prefix
            cache (vLLM's argument): a SHA-256 digest chained over the block's tokens and its
            prefix, so rows cannot be crafted to share another row's KV (vLLM's CVE-2025-25183
            fix); a hit is also checked against the tokens. ``PREFIX_CACHING_HASH_ALGOS`` lists
            the values implemented.
        speculative_config (dict | SpeculativeConfig | None, default None): speculative
            decoding (vLLM's argument), e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_max": 4, "prompt_lookup_min": 1}``: a row's likely next tokens are
            checked in one forward, and only tokens plain decoding would produce are kept, greedy
            or seeded (``docs/architecture.md``, "Speculative decoding"). Each step the engine
            picks 0..k draft tokens per row from the row's acceptance and the step times it has
            measured, so large running sets draft nothing. None: off.

    Example:
        >>> EngineConfig(max_num_seqs=128).attention_batch_size
        64
    """

    dtype: str = "auto"
    device: str = "auto"
    expert_backend: str = "native"
    max_num_seqs: int = 256
    attention_batch_size: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    swap_space_bytes: int = 0
    suspend_policy: str = "most_progress"
    refill_threshold: float = 0.75
    max_model_len: int | None = None
    seed: int = 0
    collect_timeline: bool = False
    tune_gemms: bool = True
    expert_parallel_size: int = 1
    rank_timeout_s: float = 120.0
    bind_rank_cpus: bool | None = None
    distributed_executor_backend: str | None = None
    placement_strategy: str = "PACK"
    rank_resources: dict | None = None
    weight_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    memory_utilization: float | None = None
    enable_chunked_prefill: bool = True
    speculative_config: Any = None  # SpeculativeConfig after __post_init__ (a dict is accepted)

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        for name in ("max_num_seqs", "attention_batch_size", "max_num_batched_tokens", "block_size", "expert_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.swap_space_bytes < 0:
            raise ConfigError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.suspend_policy not in SUSPEND_POLICIES:
            raise ConfigError(f"suspend_policy must be one of {SUSPEND_POLICIES}, got {self.suspend_policy!r}")
        if not 0.0 < self.refill_threshold <= 1.0:
            raise ConfigError(f"refill_threshold must be in (0, 1], got {self.refill_threshold}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {self.dtype!r}")
        if not self.rank_timeout_s > 0:
            raise ConfigError(f"rank_timeout_s must be > 0, got {self.rank_timeout_s}")
        budget = self.weight_memory_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"weight_memory_bytes must be None or an int >= 1 (bytes), got {budget!r}")
        if budget is not None and self.expert_parallel_size > 1:
            raise ConfigError(
                f"weight_memory_bytes={budget} (streamed experts) cannot be combined with expert_parallel_size="
                f"{self.expert_parallel_size}: use one or the other"
            )
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ConfigError(f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, "
                              f"got {self.prefix_caching_hash_algo!r}")
        share = self.memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ConfigError(f"memory_utilization must be None or in (0, 1], got {share!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                              f"got {self.distributed_executor_backend!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                              f"got {self.placement_strategy!r}")
        bundle = self.rank_resources
        if bundle is not None and not _valid_bundle(bundle):
            raise ConfigError(f"rank_resources must map resource names to numbers >= 0, at least one > 0 "
                              f"(one rank's placement group bundle, e.g. {{'CPU': 1, 'GPU': 1}}), got {bundle!r}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ConfigError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {self.expert_backend!r}")

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as err:
            raise ConfigError(f"device {self.device!r} is not a torch device: {err}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def _valid_bundle(bundle) -> bool:
    if not isinstance(bundle, dict) or not bundle:
        return False
    amounts = list(bundle.values())
    return (all(isinstance(k, str) for k in bundle)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in amounts)
            and any(v > 0 for v in amounts))
