"""Map-style pipe operations, under the names torch.utils.data.datapipes.map gives them."""

from pipeload.datapipes.map.callable import Mapper
from pipeload.datapipes.map.combinatorics import Shuffler
from pipeload.datapipes.map.combining import Concater, Zipper
from pipeload.datapipes.map.converters import MapToIterConverter
from pipeload.datapipes.map.grouping import Batcher
from pipeload.datapipes.nonblocking import NonBlockingMapDataPipe
from pipeload.datapipes.protocol import NotAvailable
from pipeload.datapipes.sources.files import FileReader
from pipeload.datapipes.sources.memory import SequenceWrapper

__all__ = [
    "Batcher", "Concater", "FileReader", "MapToIterConverter", "Mapper", "NonBlockingMapDataPipe", "NotAvailable",
    "SequenceWrapper", "Shuffler", "Zipper"]
