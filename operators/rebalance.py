"""The Ray Data stage's use of the work pool (``batchgen_data/rebalance/client``): each
``BatchGenOperator`` actor's ``RebalanceClient``, whose rows' results are the stage's
``RowResult`` (travelling through the pool as plain dicts), and whose actor exits when its engine
dies, so Ray restarts it (``restart.exit_for_restart``)."""

from __future__ import annotations

from dataclasses import asdict

from batchgen_data.operators.columns import RowResult
from batchgen_data.operators.restart import exit_for_restart

from batchgen_data.engine.async_engine import AsyncEngine
from batchgen_data.rebalance.client import PoolMembership, RebalanceClient, ResultCodec
from batchgen_data.rebalance.transport import PoolTransport


def _row_result(wire: dict) -> RowResult:
    return RowResult(**wire)


# A row's result as the stage emits it, and as it travels through the pool.
ROW_RESULTS = ResultCodec(from_output=RowResult.from_output, to_wire=asdict, from_wire=_row_result)


def stage_client(engine: AsyncEngine, stage_key: str, lease_timeout_s: float,
                 coordinator: PoolMembership | PoolTransport | None = None, calibrate: bool = True,
                 max_calls: int | None = None) -> RebalanceClient:
    """The client of one stage actor (``RebalanceClient``'s arguments), making ``RowResult`` rows."""
    return RebalanceClient(engine, stage_key, lease_timeout_s, coordinator, calibrate=calibrate, codec=ROW_RESULTS,
                           on_engine_dead=exit_for_restart, max_calls=max_calls)
