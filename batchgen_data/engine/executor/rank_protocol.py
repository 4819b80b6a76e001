"""What the expert-parallel driver and its rank processes say to each other (plain data).

One ``RankCommand`` goes to every rank per driver step and every rank answers with one
``StepResult``: that is the lockstep — each command with ``step=True`` makes every rank run
exactly one forward, whose MoE layers meet in their all-to-alls. Requests travel as the engine
core's plain records: ``NewRequest`` in, ``RequestProgress`` and ``FinishedRequest`` out.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from batchgen_data.engine.core.progress import RequestProgress
from batchgen_data.engine.core.request import FinishedRequest, NewRequest
from batchgen_data.engine.core.sequence import SequenceState
from batchgen_data.engine.stats import RankStats


@dataclass(slots=True)
class RankSetup:
    """The first message to a rank: what to load and where it sits in the group."""

    model_path: str
    config: dict  # EngineConfig fields
    rank: int
    world_size: int
    master_port: int
    num_threads: int
    master_addr: str = "127.0.0.1"  # rank 0's node address (its routable IP when ranks are Ray actors)
    device_index: int | None = None  # the CUDA device this rank uses; None: its rank (local ranks)


@dataclass(slots=True)
class RankReady:
    rank: int
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_token: int
    expert_weight_bytes: int
    owned_experts: tuple[int, ...]


@dataclass(slots=True)
class RankCommand:
    add: list[NewRequest] = field(default_factory=list)
    imports: list[SequenceState] = field(default_factory=list)  # MIGRATE in, request ids kept
    export_ids: list[int] = field(default_factory=list)  # MIGRATE out exactly these (a plan, or the caller)
    export_with_kv: bool = False  # their KV travels with them
    step: bool = True  # run one forward (every rank gets the same value)
    shutdown: bool = False


@dataclass(slots=True)
class RankLoad:
    """A rank's work after its step, for placing new requests and evening ranks at the tail."""

    num_running: int
    num_queued: int  # waiting or suspended
    tokens_left: int  # sum of max_tokens budgets left over its unfinished sequences
    free_slots: int  # running slots below max_num_seqs


@dataclass(slots=True)
class StepResult:
    rank: int
    finished: list[FinishedRequest]
    # Requests imported, or that ran or changed status, in this step (``ProgressPublisher``).
    progress: list[RequestProgress]
    exported: list[SequenceState]
    load: RankLoad
    stats: RankStats
    num_tokens: int  # forward tokens this step (0: it joined with a zero-token forward)
    num_sampled: int  # tokens sampled this step
    step_s: float
    comm_s: float  # of which exchanging tokens
    comm_spans: list[tuple[float, float]] = field(default_factory=list)  # (arrived, left) per collective


@dataclass(slots=True)
class RankFailure:
    """A rank's last word before it exits."""

    rank: int
    error: str


def send(conn: Connection, message) -> None:
    """Plain pickle, not ``Connection.send``'s ForkingPickler: torch registers reducers there that
    share tensors through file descriptors and the sending process's multiprocessing auth key,
    which a separately started rank does not have. A KV tensor travels as a copy."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())
