"""``torch.utils.data.datapipes.iter.streamreader``'s path under pipeload: ``StreamReader`` (which lives in ``pipeload.datapipes.sources.files``), under
torch's long name too, for scripts that import it from there."""

from pipeload.datapipes.sources.files import StreamReader

StreamReaderIterDataPipe = StreamReader

__all__ = ["StreamReaderIterDataPipe", "StreamReader"]
