"""``torch.utils.data._utils``'s path under pipeload, for scripts that reach into it:
``pipeload._utils.collate`` (the collate functions and their type map) and
``pipeload._utils.worker`` (``get_worker_info``). Thin re-exports of ``pipeload.collate`` and
``pipeload.engine.worker_info``; torch's other private modules here (``fetch``, ``pin_memory``,
``signal_handling``) belong to its loader machinery, which pipeload does not use.
"""

from pipeload._utils import collate, worker

__all__ = ["collate", "worker"]
