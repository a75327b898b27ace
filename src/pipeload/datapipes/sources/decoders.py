"""``decode``: bytes to Python objects, chosen by file extension, each choice overridable.

Images go through Pillow (a faster JPEG decoder, simplejpeg, is used for ``image="numpy"`` or
``"tensor"`` where it is installed); ``.json`` through json, ``.npy`` through numpy, ``.pt`` /
``.pth`` through ``torch.load(weights_only=True)``, ``.txt`` to text, ``.cls`` / ``.index`` to
an int. A ``.gz`` field is decompressed, then decoded by the extension before it (``.json.gz`` as
JSON), as WebDataset does. Anything else stays bytes.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch

from pipeload.datapipes.base import IterDataPipe
from pipeload.datapipes.iter._columns import length_of
from pipeload.datapipes.protocol import PipeIterator
from pipeload.datapipes.sources.errors import describe_failure, redact_url
from pipeload.datapipes.sources.on_error import SAMPLE, ErrorPolicyMixin, FailureHandler, OnError, check_policy

ImageOutput = Literal["pil", "numpy", "tensor"]
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "bmp", "webp", "tif", "tiff", "gif"})
_JPEG_EXTENSIONS = frozenset({"jpg", "jpeg"})
_IMAGE_OUTPUTS = ("pil", "numpy", "tensor")


class SampleDecodeError(ValueError):
    """A field of a sample could not be decoded; names the sample, the extension and the archive."""


def decode_image(data: bytes, output: ImageOutput = "pil", extension: str = "") -> Any:
    """An image from encoded bytes: a PIL image, an RGB ``uint8`` HWC array, or a CHW tensor."""
    if output != "pil" and extension in _JPEG_EXTENSIONS:
        array = _fast_jpeg(data)
        if array is not None:
            return array if output == "numpy" else torch.from_numpy(array).permute(2, 0, 1)
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()  # decode now, inside the pipe, so a corrupt image fails here (and is named)
    if output == "pil":
        return image
    array = np.asarray(image.convert("RGB"))
    return array if output == "numpy" else torch.from_numpy(array.copy()).permute(2, 0, 1)


def _fast_jpeg(data: bytes) -> np.ndarray | None:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg.decode_jpeg(data, colorspace="RGB")


def decode_json(data: bytes) -> Any:
    return json.loads(data)


def decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_torch(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def text_lines(data: bytes) -> list[str]:
    """The lines of UTF-8 text, without their line endings (use as ``handlers={"txt": text_lines}``)."""
    return data.decode("utf-8").splitlines()


def decode_int(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def gunzip(data: bytes) -> bytes:
    """Decompressed gzip data (``decode`` then decodes it by the extension before ``.gz``)."""
    return gzip.decompress(data)


def default_handlers(image: ImageOutput = "pil") -> dict[str, Callable[[bytes], Any]]:
    """Extension -> decoder, as ``decode`` uses them unless told otherwise."""
    handlers: dict[str, Callable[[bytes], Any]] = {
        "json": decode_json, "npy": decode_npy, "pt": decode_torch, "pth": decode_torch,
        "txt": decode_text, "text": decode_text, "cls": decode_int, "cls2": decode_int,
        "index": decode_int, "gz": gunzip,
    }
    for extension in IMAGE_EXTENSIONS:
        handlers[extension] = functools.partial(decode_image, output=image, extension=extension)
    return handlers


class Decoder(IterDataPipe[Any], ErrorPolicyMixin):
    """Decode each sample's fields by extension (functional name: ``decode``).

    Takes WebDataset samples (dicts: every field not starting with ``__`` is decoded by the last
    part of its extension, ``seg.png`` by ``png``) or ``(path, bytes)`` pairs (decoded by the
    path's extension). Fields with no handler stay bytes.

    Args:
        datapipe: yields sample dicts or ``(path, bytes)`` pairs.
        handlers: extension -> ``fn(bytes)``, over the defaults; ``None`` leaves that extension
            undecoded.
        image: what images become: ``"pil"`` (PIL images), ``"numpy"`` (RGB uint8 HWC arrays),
            ``"tensor"`` (RGB uint8 CHW tensors).
        on_error, max_failures: a sample that fails to decode; see
            ``pipeload.datapipes.sources.on_error``.

    Example:
        >>> samples = shards.load_from_tar().webdataset().decode(image="tensor")
        >>> sample = next(iter(samples)); sample["jpg"].shape, sample["cls"]
        (torch.Size([3, 32, 32]), 7)
    """

    _parent_fields = ("datapipe",)

    def __init__(self, datapipe: IterDataPipe, handlers: Mapping[str, Callable[[bytes], Any] | None] | None = None,
                 *, image: ImageOutput = "pil", on_error: OnError = "raise", max_failures: int | None = None) -> None:
        if image not in _IMAGE_OUTPUTS:
            raise ValueError(f"Decoder: image must be one of {_IMAGE_OUTPUTS}, got image={image!r}")
        check_policy(on_error, max_failures, "Decoder")
        check_handlers(handlers, "Decoder")
        self.datapipe = datapipe
        self.handlers = {**default_handlers(image), **{k.lower(): v for k, v in (handlers or {}).items()}}
        self.image = image
        self.on_error = on_error
        self.max_failures = max_failures

    def decode_field(self, extension: str, data: Any) -> Any:
        """``data`` decoded as a file with ``extension`` (``"seg.png"`` counts as ``"png"``;
        ``"json.gz"`` is decompressed, then decoded as ``"json"``)."""
        inner, _, last = extension.rpartition(".")
        handler = self.handlers.get(last.lower())
        if handler is None or not isinstance(data, (bytes, bytearray, memoryview)):
            return data
        decoded = handler(bytes(data))
        if handler is gunzip and inner:
            return self.decode_field(inner, decoded)
        return decoded

    def decode_sample(self, sample: Any) -> Any:
        """One sample decoded: a dict field by field, or a ``(path, bytes)`` pair.

        Raises:
            SampleDecodeError: naming the sample, the field and the archive (the cause chained).
        """
        if isinstance(sample, dict):
            return {field: value if field.startswith("__") else self._decode_named(sample, field, value)
                    for field, value in sample.items()}
        path, data = sample
        name = path.rsplit("/", 1)[-1]
        return path, self._decode_named(sample, name.split(".", 1)[1] if "." in name else "", data)

    def _decode_named(self, sample: Any, field: str, data: Any) -> Any:
        try:
            return self.decode_field(field, data)
        except Exception as error:
            url, key = _where(sample)
            shown = redact_url(url) if isinstance(url, str) else url
            raise SampleDecodeError(f"decode: cannot decode field {field!r} of sample {key!r} in "
                                    f"{shown!r}: {describe_failure(error)}") from error

    def __iter__(self) -> Iterator[Any]:
        return _DecodeIterator(self, self._failure_handler("decode", "the sample", SAMPLE))

    def __len__(self) -> int:
        return length_of(self.datapipe, self)


class _DecodeIterator(PipeIterator[Any]):
    def __init__(self, pipe: Decoder, failures: FailureHandler) -> None:
        super().__init__(pipe.datapipe)
        (self._samples,) = self.upstream
        self._pipe = pipe
        self.failures = failures

    def nonblocking_next(self) -> Any:
        while True:
            sample = self._samples.nonblocking_next()
            try:
                return self._pipe.decode_sample(sample)
            except SampleDecodeError as error:
                url, key = _where(sample)
                self.failures.handle(error, self.failures.site(url, key))


def _where(sample: Any) -> tuple[str | None, str | None]:
    if isinstance(sample, dict):
        return sample.get("__url__"), sample.get("__key__")
    archive = getattr(sample, "archive", None)
    return (archive, sample.name) if archive is not None else (None, sample[0])


def check_handlers(handlers: Any, caller: str) -> None:
    """None, or a mapping of extensions to a callable or None (None leaves it undecoded),
    refused when the pipe is built: a handler that is not a function failed every sample, which
    ``on_error="skip"`` then skipped, an epoch of nothing for a typo."""
    if handlers is None:
        return
    if not isinstance(handlers, Mapping):
        raise TypeError(f"{caller}: handlers must be a mapping of extensions to "
                        f"fn(bytes) or None, got handlers={handlers!r}")
    for extension, handler in handlers.items():
        if not isinstance(extension, str):
            raise TypeError(f"{caller}: handlers' keys must be extensions (str), got "
                            f"{extension!r} in handlers={handlers!r}")
        if handler is not None and not callable(handler):
            raise TypeError(f"{caller}: handlers[{extension!r}] must be a callable "
                            f"fn(bytes) or None, got {handler!r} ({type(handler).__name__})")
