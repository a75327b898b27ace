"""Where a graph splits across workers and ranks: ``sharding_filter``."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any, TypeVar

from pipeload._state_fields import StateFields
from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import check_int, no_length
from pipeload.datapipes.protocol import PipeIterator
from pipeload.datapipes.torch_loader import shard_in_torch_worker

T_co = TypeVar("T_co", covariant=True)


class SHARDING_PRIORITIES(enum.IntEnum):  # noqa: N801  (torch's name)
    """Sharding groups; with several, the lower value is the outer split (as in torch)."""

    DEFAULT = 1
    DISTRIBUTED = 2
    MULTIPROCESSING = 3


class ShardingFilter(IterDataPipe[T_co]):
    """Keep every ``num_of_instances``-th item, starting at ``instance_id`` (functional name:
    ``sharding_filter``).

    Until :meth:`apply_sharding` is called (by the DataLoader in each worker, or by
    ``pipeload.datapipes.graph.apply_sharding``) it passes everything through. Put it early,
    before expensive work, so each worker only pays for its own share; anything random before it
    (a shuffle) must draw the same numbers in every worker, which the loader's seeding ensures.

    Args:
        source_datapipe: the pipe to split.
        sharding_group_filter: obey only this group's sharding (None: combine all groups).

    Example:
        >>> dp = IterableWrapper(range(10)).sharding_filter()
        >>> list(dp.apply_sharding(3, 1))
        [1, 4, 7]
    """

    _parent_fields = ("source_datapipe",)

    def __init__(self, source_datapipe: IterDataPipe, sharding_group_filter: Any = None) -> None:
        self.source_datapipe = source_datapipe
        self.sharding_group_filter = sharding_group_filter
        self.groups: dict[int, tuple[int, int]] = {}
        self.num_of_instances = 1
        self.instance_id = 0

    def apply_sharding(
        self,
        num_of_instances: int,
        instance_id: int,
        sharding_group: SHARDING_PRIORITIES = SHARDING_PRIORITIES.DEFAULT,
    ) -> ShardingFilter[T_co]:
        """Make this pipe yield shard ``instance_id`` of ``num_of_instances`` for ``sharding_group``.

        Raises:
            ValueError: ``instance_id`` is not below ``num_of_instances``, or is negative.
            TypeError: either is not an int.
            RuntimeError: the DEFAULT group mixed with other groups.
        """
        check_int(num_of_instances, "num_of_instances")
        check_int(instance_id, "instance_id")
        if instance_id >= num_of_instances:
            raise ValueError(
                f"instance_id({instance_id}) should be smaller than num_of_instances({num_of_instances})"
            )
        if instance_id < 0:  # torch lets it through: every item is then dropped, silently
            raise ValueError(f"instance_id({instance_id}) should be at least 0")
        default = SHARDING_PRIORITIES.DEFAULT
        has_default = default in self.groups
        has_others = any(group != default for group in self.groups)
        if (sharding_group == default and has_others) or (sharding_group != default and has_default):
            raise RuntimeError(
                "ShardingFilter cannot mix DEFAULT and non DEFAULT groups "
                f"(has {sorted(self.groups)}, asked for {sharding_group!r})"
            )
        # A new dict, never an update: copies of this pipe (thread workers' replicas) may share it.
        self.groups = {**self.groups, int(sharding_group): (num_of_instances, instance_id)}
        self._combine_groups()
        return self

    def _combine_groups(self) -> None:
        wanted = [key for key in sorted(self.groups)
                  if self.sharding_group_filter is None or key == self.sharding_group_filter]
        count, position = 1, 0
        for key in reversed(wanted):  # the highest group is the innermost split
            group_count, group_position = self.groups[key]
            position += count * group_position
            count *= group_count
        self.num_of_instances, self.instance_id = count, position

    def __iter__(self) -> Iterator[T_co]:
        count, position = self.num_of_instances, self.instance_id
        # Nobody sharded it: torch's own loader may be running it, which would split its own
        # pipes with the DEFAULT group (a filter obeying only another group ignores that).
        if not self.groups and self.sharding_group_filter in (None, SHARDING_PRIORITIES.DEFAULT):
            count, position = shard_in_torch_worker() or (count, position)
        return _ShardingIterator(count, position, self.source_datapipe)

    def __len__(self) -> int:
        try:
            length = len(self.source_datapipe)  # type: ignore[arg-type]
        except TypeError:
            raise no_length(self) from None
        count, position = self.num_of_instances, self.instance_id
        return length // count + (1 if position < length % count else 0)


class _ShardingIterator(PipeIterator[Any]):
    def __init__(self, count: int, position: int, source: Any) -> None:
        super().__init__(source)
        (self._source,) = self.upstream
        self._count = count
        self._position = position
        self._seen = 0  # items read from the source so far

    def nonblocking_next(self) -> Any:
        while True:
            item = self._source.nonblocking_next()
            index = self._seen
            self._seen += 1
            if index % self._count == self._position:
                return item

    def _own_state(self) -> Any:
        return self._seen

    def _check_own_state(self, fields: StateFields) -> Any:
        return fields.integer("own")  # items read from the source

    def _load_own_state(self, state: Any) -> None:
        self._seen = state

# torch's long names, for scripts that import them from torch's submodule of this name: the
# same classes (torch's package exports the short names, as ours does).
ShardingFilterIterDataPipe = ShardingFilter
