"""``torch.utils.data.datapipes.map.utils``'s path under pipeload: ``SequenceWrapper`` (which lives in ``pipeload.datapipes.sources.memory``), under
torch's long name too, for scripts that import it from there."""

from pipeload.datapipes.sources.memory import SequenceWrapper

SequenceWrapperMapDataPipe = SequenceWrapper

__all__ = ["SequenceWrapperMapDataPipe", "SequenceWrapper"]
