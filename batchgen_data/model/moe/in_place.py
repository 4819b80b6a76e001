"""Streamed experts read in place: the decode kernels' expert tables over the checkpoint's memory map.

On CPU a streamed store's slower tier is the checkpoint's memory map, whose pages the OS keeps in
its page cache. Copying an expert from there into a pool slot reads its bytes, writes them again,
and then the GEMM reads them a third time; for a decode step's few rows per expert that traffic,
not the arithmetic, is the step. Where the checkpoint stores each projection as the engine
computes it (the engine's dtype, [F, H] / [H, F] row-major, no biases), the decode kernels read
the mapped tensors themselves (``native/expert_table.py``): a decode step then reads each expert
once, as resident experts do, and the process's anonymous memory stays the pool's.

It applies only where every expert's tensors lie inside the process's mappings of the checkpoint
(``/proc/self/maps``: a dequantized or converted tensor is an anonymous copy, never taken) and the
machine's available memory (``MemAvailable``) can hold the experts' bytes in its page cache:
where it cannot, each decode step would read its experts from disk, synchronously, and the pool's
fetch thread, which reads ahead, is the better design.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from batchgen_data.model.expert_sources import LayerExperts
from batchgen_data.model.native.expert_table import ExpertTable, views_table

logger = logging.getLogger(__name__)


def in_place_tables(layers: dict[int, LayerExperts], folder: Path, dtype: torch.dtype, device: torch.device | str,
                    maps: str = "/proc/self/maps", meminfo: str = "/proc/meminfo") -> dict[int, ExpertTable] | None:
    """Each sparse layer's expert table over the memory-mapped checkpoint, or None where the
    experts cannot be read in place (see the module docstring; ``maps`` and ``meminfo`` are the
    files read, for tests)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    ranges = _mapped_ranges(Path(folder), maps)
    if not ranges:
        return None
    tables: dict[int, ExpertTable] = {}
    total = 0
    for layer_id, layer in layers.items():
        views = [layer.in_place(e, dtype) for e in range(layer.num_experts)]
        if any(v is None or not all(_inside(t, ranges) for t in v) for v in views):
            return None
        tables[layer_id] = views_table(views)
        total += sum(t.nbytes for v in views for t in v)
    available = _available_bytes(meminfo)
    if available is None or total > available:
        logger.info("streamed experts are copied into the pool: their %d bytes exceed MemAvailable (%s)",
                    total, available)
        return None
    return tables


def _mapped_ranges(folder: Path, maps: str) -> list[tuple[int, int]]:
    """[start, end) of every mapping of a file in ``folder``."""
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return []
    prefix = str(folder.resolve()) + "/"
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(prefix):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    lo = t.data_ptr()
    hi = lo + t.nbytes
    return any(start <= lo and hi <= end for start, end in ranges)


def _available_bytes(meminfo: str) -> int | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
