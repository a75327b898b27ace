"""``torch.utils.data.datapipes.iter.fileopener``'s path under pipeload: ``FileOpener`` (which lives in ``pipeload.datapipes.sources.files``), under
torch's long name too, for scripts that import it from there."""

from pipeload.datapipes.sources.files import FileOpener

FileOpenerIterDataPipe = FileOpener

__all__ = ["FileOpenerIterDataPipe", "FileOpener"]
