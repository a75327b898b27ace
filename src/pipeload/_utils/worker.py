"""``torch.utils.data._utils.worker``'s path under pipeload: ``from pipeload._utils.worker import
get_worker_info``.

A thin re-export of ``pipeload.engine.worker_info``: the same objects as
``pipeload.get_worker_info`` and ``pipeload.WorkerInfo``. It answers in process and thread
workers alike (torch's answers in process workers only).
"""

from pipeload.engine.worker_info import WorkerInfo, get_worker_info

__all__ = ["WorkerInfo", "get_worker_info"]
