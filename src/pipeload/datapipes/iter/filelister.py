"""``torch.utils.data.datapipes.iter.filelister``'s path under pipeload: ``FileLister`` (which lives in ``pipeload.datapipes.sources.files``), under
torch's long name too, for scripts that import it from there."""

from pipeload.datapipes.sources.files import FileLister

FileListerIterDataPipe = FileLister

__all__ = ["FileListerIterDataPipe", "FileLister"]
