"""The job's pending parts as a Ray Data datasource: one read task per part, run on this node.

``ray.data.from_arrow`` would need every part read into the driver's memory first. Here a read
task reads its part from the input file (``PartSource``) only when Ray Data's backpressure asks
for it, so memory holds the parts in flight. The input files are on the machine that runs the
job, so the tasks are pinned to this node (the driver's), as ``local://`` paths are in Ray.
Each row is tagged with its part's index among the pending parts and its row number in the part,
so the driver can put the rows of a part back together in order, whichever actor ran them.
"""

from __future__ import annotations

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from batchgen_data.jobs.inputs import JobInputs


class PartDatasource(Datasource):
    def __init__(self, inputs: JobInputs, pending: list[int], part_column: str, row_column: str):
        self.schema = inputs.schema
        self.sources = [inputs.sources[i] for i in pending]
        self.part_column, self.row_column = part_column, row_column

    def get_name(self) -> str:
        return "BatchGenParts"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def remote_args(self) -> dict:
        """Read tasks run on this node, which holds the input files."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def get_read_tasks(self, parallelism: int, **kwargs) -> list[ReadTask]:
        tasks = []
        for index, source in enumerate(self.sources):
            metadata = BlockMetadata(num_rows=source.num_rows, size_bytes=None, input_files=[source.path], exec_stats=None)
            tasks.append(ReadTask(_reader(self.schema, source, index, self.part_column, self.row_column), metadata))
        return tasks


def _reader(schema, source, index: int, part_column: str, row_column: str):
    def read():
        table = schema.conform(source.read())
        table = table.append_column(part_column, pa.array([index] * table.num_rows, pa.int64()))
        yield table.append_column(row_column, pa.array(range(table.num_rows), pa.int64()))

    return read
