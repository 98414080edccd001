"""Which part of the data this input pipeline reads: `(num_shards, index)`.

Sources shard where the data is addressed (index ranges, file lists), so each sample is
read by exactly one input pipeline instead of being read by all and then dropped.
"""

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Shard `index` of `num_shards` equal parts of the data.

    Attributes:
        num_shards: How many input pipelines split the data. 1 reads everything.
        index: This pipeline's shard, `0 <= index < num_shards`.

    Instances are immutable and may be shared across threads and processes.

    Example:

    >>> from kpipe.data import ShardSpec
    >>> spec = ShardSpec(num_shards=3, index=1)
    >>> spec.range(10), str(spec)   # samples 3, 4, 5 of 10
    ((3, 6), 'shard 1 of 3')
    >>> [ShardSpec(3, i).range(10) for i in range(3)]   # disjoint, covering everything
    [(0, 3), (3, 6), (6, 10)]
    """

    num_shards: int = 1
    index: int = 0

    def __post_init__(self):
        if not isinstance(self.num_shards, int) or isinstance(self.num_shards, bool) or self.num_shards < 1:
            raise ValueError(
                f"`num_shards` must be an integer >= 1. Received: num_shards={self.num_shards!r}. "
                "Pass the number of input pipelines (workers) that split the data."
            )
        if (
            not isinstance(self.index, int)
            or isinstance(self.index, bool)
            or not 0 <= self.index < self.num_shards
        ):
            raise ValueError(
                f"`index` must be an integer in [0, num_shards). Received: index={self.index!r}, "
                f"num_shards={self.num_shards}. Pass this pipeline's position, e.g. the worker's "
                "task index."
            )

    @property
    def sharded(self) -> bool:
        return self.num_shards > 1

    def range(self, n: int) -> Tuple[int, int]:
        """Returns `(start, stop)`: this shard's contiguous part of `range(n)`.

        The parts of all shards are disjoint, cover `range(n)`, and differ in size by at
        most one.
        """
        return (n * self.index) // self.num_shards, (n * (self.index + 1)) // self.num_shards

    def __str__(self):
        return f"shard {self.index} of {self.num_shards}"


def resolve_shard(input_context=None, num_shards: Optional[int] = None, index: Optional[int] = None) -> ShardSpec:
    """Returns the `ShardSpec` named by an `InputContext` or by `num_shards`/`index`.

    Args:
        input_context: A `tf.distribute.InputContext` (as passed to the function given to
            `strategy.distribute_datasets_from_function`); its `num_input_pipelines` and
            `input_pipeline_id` are used. Defaults to None.
        num_shards: Number of shards, when no `input_context` is given. Defaults to None
            (no sharding).
        index: This shard, with `num_shards`. Defaults to None.

    Returns:
        A `ShardSpec`; `ShardSpec(1, 0)` when nothing was given.

    Raises:
        ValueError: if both an `input_context` and `num_shards`/`index` are given, if only
            one of `num_shards`/`index` is given, or if they are out of range.
    """
    if input_context is not None:
        if num_shards is not None or index is not None:
            raise ValueError(
                "Pass either `input_context` or `num_shards`/`index`, not both. Received: "
                f"input_context={input_context!r}, num_shards={num_shards!r}, index={index!r}."
            )
        try:
            num, idx = input_context.num_input_pipelines, input_context.input_pipeline_id
        except AttributeError:
            raise TypeError(
                "`input_context` must be a `tf.distribute.InputContext`. Received: "
                f"input_context={input_context!r} of type {type(input_context).__name__}. Use the "
                "context that `strategy.distribute_datasets_from_function` passes to your function."
            ) from None
        return ShardSpec(int(num), int(idx))
    if num_shards is None and index is None:
        return ShardSpec()
    if num_shards is None or index is None:
        raise ValueError(
            "`num_shards` and `index` go together. Received: "
            f"num_shards={num_shards!r}, index={index!r}. Pass both, e.g. num_shards=4, index=0."
        )
    return ShardSpec(num_shards, index)


def merge_shards(source: ShardSpec, requested: ShardSpec, what: str) -> ShardSpec:
    """Combines a source's own shard with the one `pipeline()` asks for.

    Raises:
        ValueError: if both shard, differently.
    """
    if not requested.sharded:
        return source
    if source.sharded and source != requested:
        raise ValueError(
            f"{what} was already created as {source}, but `pipeline` was asked for {requested}. "
            "Shard in one place: pass `input_context` (or `num_shards`/`index`) to the source "
            "or to `pipeline`, not different values to both."
        )
    return requested
