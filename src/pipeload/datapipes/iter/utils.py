"""``torch.utils.data.datapipes.iter.utils``'s path under pipeload: ``IterableWrapper`` (which lives in ``pipeload.datapipes.sources.memory``), under
torch's long name too, for scripts that import it from there."""

from pipeload.datapipes.sources.memory import IterableWrapper

IterableWrapperIterDataPipe = IterableWrapper

__all__ = ["IterableWrapperIterDataPipe", "IterableWrapper"]
