"""``torch.utils.data.graph_settings``'s path under pipeload: ``from pipeload.graph_settings import
apply_sharding, apply_random_seed``.

A thin re-export of the DataPipes room's graph functions (``pipeload.datapipes.graph``), which
shard, seed and switch the shuffles of a pipe graph as torch's functions of the same names do
(the same random draws). Every name is the same object as in ``pipeload.datapipes.graph``.

Example:
    >>> from pipeload.datapipes.iter import IterableWrapper
    >>> from pipeload.graph_settings import apply_sharding
    >>> pipe = apply_sharding(IterableWrapper(range(6)).sharding_filter(), 2, 1)
    >>> list(pipe)
    [1, 3, 5]
"""

from pipeload.datapipes.graph import (
    _is_shuffler,
    apply_random_seed,
    apply_sharding,
    apply_shuffle_settings,
    is_sharding_datapipe,
    traverse_dps,
)
from pipeload.datapipes.iter.sharding import SHARDING_PRIORITIES

__all__ = ["SHARDING_PRIORITIES", "apply_random_seed", "apply_sharding", "apply_shuffle_settings",
           "traverse_dps"]

# torch's private names for the same two tests, which tools that walk graphs import.
_is_shuffle_datapipe = _is_shuffler
_is_sharding_datapipe = is_sharding_datapipe

try:  # the DataPipes room adds it (branch rfc); until then it is missing here as there
    from pipeload.datapipes.graph import get_all_graph_pipes
except ImportError:
    pass
else:
    __all__.insert(4, "get_all_graph_pipes")
