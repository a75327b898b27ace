"""Where items come from. In memory now; files, archives and remote storage drop in here.

A source is an ordinary pipe with no parents. Sources whose reading can be split across workers
expose ``apply_sharding(num_of_instances, instance_id)`` (the graph functions find them as they
find ``sharding_filter``), and sources with a position expose it through their iterator's
``state_dict()``.
"""

from pipeload.datapipes.sources.memory import IterableWrapper, SequenceWrapper

__all__ = ["IterableWrapper", "SequenceWrapper"]
