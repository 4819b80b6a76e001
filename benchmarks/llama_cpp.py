"""llama.cpp as a side-by-side CPU baseline for the decode benchmark.

llama.cpp is built from the llama-cpp-python sdist, which vendors the whole llama.cpp tree
(``vendor/llama.cpp``): the C++ sources, the Hugging Face -> GGUF converter
(``convert_hf_to_gguf.py`` plus its ``conversion`` package) and ``gguf-py``. Nothing is
installed into the virtualenv: the converter runs with the vendored ``gguf-py`` first on
``PYTHONPATH`` (no ``gguf`` package) and uses the project's ``torch``, ``numpy``,
``safetensors`` and ``transformers``; the one module it needs that the venv lacks,
``sentencepiece``, is pip-installed once into ``<cache>/llama.cpp-<version>/pydeps``.

Pieces:

* :func:`build_llama_cpp` extracts the sdist and builds ``llama-batched-bench`` once (CPU only,
  ``GGML_NATIVE=ON``, llama/ggml linked statically, ``-j2``) into ``<cache>/llama.cpp-<version>``.
* :func:`convert_to_gguf` turns a local HF checkpoint folder into a GGUF file.
* :func:`batched_bench` runs ``llama-batched-bench`` and parses its JSONL output.
* :func:`build_spm_style_tokenizer` gives a checkpoint a tokenizer the converter accepts offline
  (see its docstring for why a byte-level BPE does not).
* :func:`llama_cpp_side_by_side` does all of it for ``benchmarks/decode_steps.py --llama-cpp``.

Command line::

    python -m benchmarks.llama_cpp --hf-dir /path/to/hf --cache ~/.cache/llama_cpp \\
        --batch-sizes 1,8,16,32,64 --prompt-tokens 128 --gen-tokens 64

``llama-batched-bench`` semantics (prompt not shared, the default): for each batch size ``B`` it
clears the KV cache, prefills ``B`` independent prompts of ``PP`` tokens in one batch (timed as
``T_PP``), then runs ``TG`` decode steps, each a batch of ``B`` tokens, one per sequence (timed as
``T_TG``). So ``S_TG = B * TG / T_TG`` is decode throughput and ``T_TG / TG`` is the decode step
time. Tokens are random ids (``rand() % n_vocab``), so the tokenizer only has to load, not be
good. A batch size whose ``B*(PP+TG)`` exceeds the context is skipped *silently* by the tool;
:func:`batched_bench` sizes the context for the largest one and checks every row came back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

DEFAULT_VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp is built
BENCH_BINARY = "llama-batched-bench"
_VENDOR_PREFIX = "vendor/llama.cpp/"
# What the converter needs at run time, copied next to the binary.
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
_SENTENCEPIECE_REQ = "sentencepiece>=0.1.98,<0.3.0"  # requirements-convert_legacy_llama.txt
_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: AVX2 / AVX-512 / VNNI of this CPU
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_OPENMP=ON",
    "-DGGML_CCACHE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # a self-contained binary, no rpath to the build tree
    "-DLLAMA_CURL=OFF",  # deprecated upstream (ignored, only warns when ON); kept for older trees
    "-DLLAMA_OPENSSL=OFF",  # the replacement for curl (cpp-httplib + OpenSSL): no network needed
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # batched-bench lives in tools/
)


def _pip_constraints() -> list[str]:
    """``-c <repo>/constraints.txt`` when the project's pip constraints file exists (torch pin)."""
    constraints = Path(__file__).resolve().parents[1] / "constraints.txt"
    return ["-c", str(constraints)] if constraints.is_file() else []


def _sdist_version(sdist: Path) -> str:
    """The version from an sdist file name such as ``llama_cpp_python-0.3.36.tar.gz``."""
    match = re.search(r"-(\d+(?:\.\d+)+)\.tar\.gz$", sdist.name)
    if match is None:
        raise ValueError(f"cannot read a version from sdist name {sdist.name!r}")
    return match.group(1)


def download_sdist(dest: Path, version: str = DEFAULT_VERSION) -> Path:
    """Download the llama-cpp-python sdist (source only, no deps) into ``dest``; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"llama_cpp_python-{version}.tar.gz"
    if not target.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             *_pip_constraints(), "--dest", str(dest), f"llama-cpp-python=={version}"],
            check=True,
        )
    if not target.is_file():
        raise FileNotFoundError(f"pip download did not produce {target}")
    return target


def _extract_vendored(sdist: Path, dest: Path) -> None:
    """Extract ``<top>/vendor/llama.cpp`` of the sdist into ``dest`` (stripped of that prefix).

    The 75 MB ``models/`` folder (tokenizer test vocabularies) and git metadata are skipped.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) < 2 or not parts[1].startswith(_VENDOR_PREFIX):
                continue
            rel = parts[1][len(_VENDOR_PREFIX):]
            if not rel or rel.startswith(("models/", ".git")) or "/.git" in rel:
                continue
            member.name = rel
            members.append(member)
        if not members:
            raise FileNotFoundError(f"{sdist} has no {_VENDOR_PREFIX} folder")
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:  # Python without extraction filters (< 3.10.12 / 3.11.4)
            tar.extractall(dest, members=members)


def build_llama_cpp(cache_dir: Path, sdist: Path | None = None) -> Path:
    """Build ``llama-batched-bench`` from the llama-cpp-python sdist once; return its folder.

    The folder is ``cache_dir / "llama.cpp-<version>"`` and holds the static binary
    ``llama-batched-bench`` next to the vendored converter (``convert_hf_to_gguf.py``,
    ``conversion/``, ``gguf-py/``); the sources are in ``src/`` and the CMake tree in ``build/``
    (kept so a rebuild is incremental). If the binary is already there nothing is done.

    Args:
        cache_dir: where builds (and a downloaded sdist) live.
        sdist: the ``llama_cpp_python-<version>.tar.gz``; ``None`` downloads
            :data:`DEFAULT_VERSION` with ``pip download`` into ``cache_dir``.
    """
    cache_dir = Path(cache_dir).expanduser().resolve()
    version = _sdist_version(sdist) if sdist is not None else DEFAULT_VERSION
    root = cache_dir / f"llama.cpp-{version}"
    if (root / BENCH_BINARY).is_file() and all((root / p).exists() for p in _CONVERTER_PARTS):
        return root
    if sdist is None:
        sdist = download_sdist(cache_dir, version)
    src, build = root / "src", root / "build"
    if not (src / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        _extract_vendored(Path(sdist), src)
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake is required to build llama.cpp (apt-get install cmake)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(src), "-B", str(build), *generator, *_CMAKE_FLAGS], check=True)
    subprocess.run([cmake, "--build", str(build), "--target", BENCH_BINARY, "-j2"], check=True)
    built = build / "bin" / BENCH_BINARY
    if not built.is_file():
        raise FileNotFoundError(f"build finished but {built} is missing")
    for part in _CONVERTER_PARTS:
        target = root / part
        if (src / part).is_dir():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(src / part, target)
        else:
            shutil.copy2(src / part, target)
    shutil.copy2(built, root / f".{BENCH_BINARY}.tmp")  # binary last: it marks the build done
    os.replace(root / f".{BENCH_BINARY}.tmp", root / BENCH_BINARY)
    return root


def _converter_deps(llama_dir: Path) -> list[str]:
    """Extra ``PYTHONPATH`` entries the converter needs beyond this virtualenv.

    Only ``sentencepiece``: for every Llama-family model (Mixtral included) the converter first
    tries the SentencePiece vocab, and it imports ``sentencepiece`` *before* checking for a
    ``tokenizer.model``, so without the module it dies with ``ModuleNotFoundError`` instead of
    falling back to ``tokenizer.json``. If the venv lacks it, it is pip-installed once (no deps,
    the converter's own pin) into ``llama_dir/pydeps``, leaving the venv untouched.
    """
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        return []
    target = Path(llama_dir) / "pydeps"
    if not (target / "sentencepiece").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *_pip_constraints(),
             "--target", str(target), _SENTENCEPIECE_REQ],
            check=True,
        )
    return [str(target)]


def convert_to_gguf(hf_dir: Path, out_file: Path, llama_dir: Path, outtype: str = "f32") -> Path:
    """Convert a local Hugging Face checkpoint folder to GGUF with the vendored converter.

    Runs ``convert_hf_to_gguf.py`` with this interpreter and the vendored ``gguf-py`` first on
    ``PYTHONPATH`` (no ``gguf`` pip package needed). The one extra module it needs,
    ``sentencepiece``, comes from the venv if present, else from ``llama_dir/pydeps``
    (see :func:`_converter_deps`; installing it there needs the package index once).
    Skipped if ``out_file`` exists; the file is written under a temporary name and renamed,
    so a failed run leaves nothing behind.

    Args:
        hf_dir: folder with ``config.json``, safetensors weights and tokenizer files.
        out_file: the ``.gguf`` to write.
        llama_dir: the folder :func:`build_llama_cpp` returned.
        outtype: ``f32``, ``f16``, ``bf16`` or ``q8_0`` (the converter's ``--outtype``).
    """
    out_file = Path(out_file)
    if out_file.is_file():
        return out_file
    llama_dir = Path(llama_dir)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.partial")
    env = dict(os.environ)
    paths = [str(llama_dir / "gguf-py"), *_converter_deps(llama_dir), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop("NO_LOCAL_GGUF", None)  # the converter then puts gguf-py first on sys.path too
    env.setdefault("HF_HUB_OFFLINE", "1")
    try:
        subprocess.run(
            [sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(hf_dir),
             "--outfile", str(tmp), "--outtype", outtype],
            check=True, env=env, cwd=str(llama_dir),
        )
        os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file


def _parse_markdown(text: str) -> list[dict]:
    """Rows of the batched-bench markdown table as dicts keyed like its JSONL output."""
    keys = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(keys) or not cells[0].isdigit():
            continue
        rows.append({k: (int(v) if i < 4 else float(v))
                     for i, (k, v) in enumerate(zip(keys, cells))})
    return rows


def batched_bench(
    gguf: Path,
    llama_dir: Path,
    batch_sizes: list[int],
    prompt_tokens: int,
    gen_tokens: int,
    threads: int = 2,
    kv_type: str = "f32",
    flash_attn: bool = False,
) -> list[dict]:
    """Run ``llama-batched-bench`` (prompts not shared) and return one dict per batch size.

    Each dict has ``batch_size``, ``prompt_tokens``, ``gen_tokens``, ``n_kv``,
    ``prefill_s``/``prompt_tok_s`` (``T_PP``/``S_PP``: all ``B*PP`` prompt tokens in one
    batch), ``decode_s``/``decode_tok_s`` (``T_TG``/``S_TG``), ``decode_step_ms``
    (``T_TG / TG``: one step decodes ``B`` tokens), ``total_s``/``total_tok_s`` and the raw row.

    The context is sized to the largest batch (``B*(PP+TG)``) and the logical and physical
    batch to at least the largest prefill, so each prefill is a single ``llama_decode``. Flash
    attention is passed explicitly (``-fa on|off``): upstream's default is ``auto``.
    """
    binary = Path(llama_dir) / BENCH_BINARY
    n_max = max(batch_sizes)
    ctx = n_max * (prompt_tokens + gen_tokens)
    n_batch = max(2048, n_max * prompt_tokens)
    cmd = [
        str(binary), "-m", str(gguf),
        "-c", str(ctx), "-b", str(n_batch), "-ub", str(min(n_batch, 512)),
        "-npp", str(prompt_tokens), "-ntg", str(gen_tokens),
        "-npl", ",".join(str(b) for b in batch_sizes),
        "-t", str(threads), "-tb", str(threads),
        "-ctk", kv_type, "-ctv", kv_type,
        "-fa", "on" if flash_attn else "off",
        "--output-format", "jsonl",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    text = proc.stdout + "\n" + proc.stderr  # results are LOG()ged; do not rely on which stream
    raw = [json.loads(line) for line in text.splitlines()
           if line.lstrip().startswith('{"n_kv_max"')]
    if not raw:
        raw = _parse_markdown(text)
    missing = sorted(set(batch_sizes) - {int(row["pl"]) for row in raw})
    if missing:
        raise RuntimeError(
            f"llama-batched-bench returned no row for batch sizes {missing}:\n{text[-4000:]}"
        )
    results = []
    for row in raw:
        results.append({
            "batch_size": int(row["pl"]),
            "prompt_tokens": int(row["pp"]),
            "gen_tokens": int(row["tg"]),
            "n_kv": int(row["n_kv"]),
            "prefill_s": float(row["t_pp"]),
            "prompt_tok_s": float(row["speed_pp"]),
            "decode_s": float(row["t_tg"]),
            "decode_tok_s": float(row["speed_tg"]),
            "decode_step_ms": 1000.0 * float(row["t_tg"]) / int(row["tg"]),
            "total_s": float(row["t"]),
            "total_tok_s": float(row["speed"]),
            "raw": row,
            "command": cmd,
        })
    return results


# --- a tokenizer the converter accepts offline -------------------------------------------------

_SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def _synthetic_corpus(seed: int, n_lines: int = 40_000) -> list[str]:
    """Pseudo-words from random syllables: enough distinct subwords to fill an 8k BPE vocab."""
    import random

    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
              "v", "w", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "str",
              "th", "tr"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "ie"]
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "rk", "ck"]
    syllables = [o + n + c for o in onsets for n in nuclei for c in codas]
    # A Zipf-ish lexicon: a few thousand frequent words, each 1-4 syllables.
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
               for _ in range(20_000)]
    weights = [1.0 / (rank + 10) for rank in range(len(lexicon))]
    punct = [".", ".", ".", ",", "?", "!", ";", ":"]
    lines = []
    for _ in range(n_lines):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(4, 18))
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice(punct))
    return lines


def build_spm_style_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0, max_length: int = 4096):
    """Train a Llama/Mistral-style BPE (``▁`` word prefix, byte fallback) and save it as a fast
    HF tokenizer (``tokenizer.json`` + config) in ``out_dir``; return the tokenizer.

    Layout matches Mixtral's: ``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<0x00>``..``<0xFF>``=3..258,
    then merged pieces, exactly ``vocab_size`` entries. The converter takes this through
    ``LlamaHfVocab`` (a BPE with ``byte_fallback`` and a ``Sequence`` decoder), which needs no
    pre-tokenizer hash; a GPT-2 byte-level BPE would go through ``get_vocab_base_pre`` and be
    rejected because a locally trained vocabulary never matches a known hash.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPM_SPECIALS + _BYTE_TOKENS, show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE reached only {tok.get_vocab_size()} of {vocab_size} tokens")
    # Byte tokens belong to the model vocabulary, not to the added (special) tokens.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in _SPM_SPECIALS]
    spec["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    tok = Tokenizer.from_str(json.dumps(spec))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        add_bos_token=True, add_eos_token=False, clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )
    hf.save_pretrained(str(out_dir))
    return hf


def ensure_tokenizer(hf_dir: Path, vocab_size: int) -> None:
    """Give a checkpoint without one (the benchmark models take token ids) a tokenizer the
    converter accepts, of the model's vocabulary size (:func:`build_spm_style_tokenizer`)."""
    if not (Path(hf_dir) / "tokenizer.json").is_file():
        build_spm_style_tokenizer(Path(hf_dir), vocab_size)


def llama_cpp_side_by_side(hf_dir: Path, batch_sizes: list[int], prompt_tokens: int, gen_tokens: int,
                           threads: int, kv_types: tuple[str, ...] = ("f32", "f16")) -> dict[str, list[dict]]:
    """llama.cpp's decode and prefill rates on ``hf_dir``'s weights in F32, flash attention off,
    for each KV type (f32: its exact mode; f16: its default), keyed by KV type; built and
    converted once into the cache (``<cache>/llama.cpp``)."""
    from batchgen_data.model import ModelConfig
    from batchgen_data.paths import cache_dir

    root = cache_dir() / "llama.cpp"
    ensure_tokenizer(hf_dir, ModelConfig.from_pretrained(hf_dir).vocab_size)
    llama_dir = build_llama_cpp(root)
    gguf = convert_to_gguf(hf_dir, root / "gguf" / f"{Path(hf_dir).name}-f32.gguf", llama_dir, "f32")
    results = {}
    for kv in kv_types:
        rows = batched_bench(gguf, llama_dir, batch_sizes, prompt_tokens, gen_tokens, threads, kv_type=kv)
        results[kv] = [{"running": r["batch_size"], "decode_tokens_per_s": r["decode_tok_s"],
                        "step_ms": r["decode_step_ms"], "prefill_tokens_per_s": r["prompt_tok_s"],
                        "command": " ".join(r["command"])} for r in rows]
    return results


def main(argv: list[str] | None = None) -> None:
    """Build llama.cpp, convert ``--hf-dir`` to GGUF and print batched-bench results as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", type=Path, required=True,
                        help="HF checkpoint folder (with a tokenizer.json the converter accepts)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "batchgen_llama_cpp")
    parser.add_argument("--sdist", type=Path, default=None,
                        help="llama-cpp-python sdist (default: pip download it)")
    parser.add_argument("--batch-sizes", default="1,8,16,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--kv-type", default="f32")
    parser.add_argument("--flash-attn", action="store_true")
    args = parser.parse_args(argv)

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    llama_dir = build_llama_cpp(args.cache, args.sdist)
    timings["build_s"] = time.perf_counter() - t0
    hf_dir = args.hf_dir.resolve()
    gguf = args.cache.expanduser() / "gguf" / f"{hf_dir.name}-{args.outtype}.gguf"
    t0 = time.perf_counter()
    convert_to_gguf(hf_dir, gguf, llama_dir, args.outtype)
    timings["convert_s"] = time.perf_counter() - t0
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    t0 = time.perf_counter()
    rows = batched_bench(gguf, llama_dir, sizes, args.prompt_tokens, args.gen_tokens,
                         threads=args.threads, kv_type=args.kv_type, flash_attn=args.flash_attn)
    timings["bench_s"] = time.perf_counter() - t0
    print(json.dumps({"llama_dir": str(llama_dir), "gguf": str(gguf), "timings": timings,
                      "results": rows}, indent=2))


if __name__ == "__main__":
    main()
