"""``torch.utils.data._utils.worker``'s path under pipeload: ``from pipeload._utils.worker import
get_worker_info``.

A thin re-export of ``pipeload.engine.worker_info``: the same objects as
``pipeload.get_worker_info`` and ``pipeload.WorkerInfo``. It answers in process and thread
workers alike (torch's answers in process workers only).

Like torch's module, it has ``_worker_info``: reading it gives what ``get_worker_info()`` gives;
setting it (as torch's own tests do, to make ``default_collate`` act as inside a worker process)
makes ``get_worker_info()`` answer with that value wherever no worker of ours is running, until
it is set back to None.
"""

import sys
import types
from typing import Any

from pipeload.engine import worker_info as _engine
from pipeload.engine.worker_info import WorkerInfo, get_worker_info
from pipeload.engine.worker_info import numpy_seed_words as _generate_state  # torch's private name: its
# four seed words for numpy from a worker's base seed and id, which worker_init_fns reuse

__all__ = ["WorkerInfo", "get_worker_info"]


class _WorkerModule(types.ModuleType):
    @property
    def _worker_info(self) -> Any:
        return get_worker_info()

    @_worker_info.setter
    def _worker_info(self, value: Any) -> None:
        _engine.pose_as_worker(value)


sys.modules[__name__].__class__ = _WorkerModule
