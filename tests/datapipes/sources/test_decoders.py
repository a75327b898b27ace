"""decode: each default handler, the three image outputs, overrides, and a corrupt field named by
sample, field and archive, raised or skipped."""

from __future__ import annotations

import gzip
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from pipeload.datapipes.iter import IterableWrapper
from pipeload.datapipes.sources import (
    FailureCounts,
    SampleDecodeError,
    SkippedSampleWarning,
    text_lines,
)


def png(color: tuple[int, int, int], size: tuple[int, int] = (4, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def tensor_bytes(value: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def npy_bytes(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, value)
    return out.getvalue()


SAMPLE = {
    "__key__": "k", "__url__": "shard.tar",
    "seg.png": png((1, 2, 3)), "json": json.dumps({"a": [1, 2]}).encode(), "npy": npy_bytes(np.arange(4)),
    "pt": tensor_bytes(torch.ones(2)), "txt": "héllo\nworld".encode(), "cls": b" 7\n", "bin": b"\x00\x01",
}


def test_every_default_handler() -> None:
    (decoded,) = list(IterableWrapper([SAMPLE]).decode())
    assert decoded["__key__"] == "k" and decoded["__url__"] == "shard.tar"
    assert isinstance(decoded["seg.png"], Image.Image) and decoded["seg.png"].getpixel((0, 0)) == (1, 2, 3)
    assert decoded["json"] == {"a": [1, 2]}
    assert np.array_equal(decoded["npy"], np.arange(4))
    assert torch.equal(decoded["pt"], torch.ones(2))
    assert decoded["txt"] == "héllo\nworld" and decoded["cls"] == 7 and decoded["bin"] == b"\x00\x01"


@pytest.mark.parametrize("output", ["numpy", "tensor"])
def test_images_as_arrays_and_tensors(output: str) -> None:
    jpeg = io.BytesIO()
    Image.new("RGB", (5, 6), (200, 10, 10)).save(jpeg, "JPEG", quality=95)
    (decoded,) = list(IterableWrapper([{"__key__": "k", "png": png((9, 8, 7)), "jpg": jpeg.getvalue()}]).decode(image=output))
    if output == "numpy":
        assert decoded["png"].shape == (3, 4, 3) and decoded["png"].dtype == np.uint8
        assert tuple(decoded["png"][0, 0]) == (9, 8, 7) and decoded["jpg"].shape == (6, 5, 3)
    else:
        assert decoded["png"].shape == (3, 3, 4) and decoded["png"].dtype == torch.uint8
        assert decoded["png"][:, 0, 0].tolist() == [9, 8, 7] and decoded["jpg"].shape == (3, 6, 5)
        assert abs(int(decoded["jpg"][0, 0, 0]) - 200) < 8  # lossy, but red


def test_handlers_override_add_and_switch_off() -> None:
    pipe = IterableWrapper([SAMPLE]).decode({"TXT": text_lines, "bin": bytes.hex, "json": None})
    (decoded,) = list(pipe)
    assert decoded["txt"] == ["héllo", "world"] and decoded["bin"] == "0001"
    assert decoded["json"] == SAMPLE["json"]


def test_path_pairs_decode_by_the_paths_extension() -> None:
    pairs = IterableWrapper([("s.tar/a.json", b"[1]"), ("s.tar/b.cls", b"3"), ("s.tar/noext", b"x")])
    assert list(pairs.decode()) == [("s.tar/a.json", [1]), ("s.tar/b.cls", 3), ("s.tar/noext", b"x")]


def test_a_corrupt_field_names_the_sample_the_field_and_the_archive() -> None:
    broken = {**SAMPLE, "__key__": "bad", "seg.png": b"\x89PNG not really"}
    with pytest.raises(SampleDecodeError, match=r"field 'seg.png' of sample 'bad' in 'shard.tar'") as raised:
        list(IterableWrapper([broken]).decode())
    assert raised.value.__cause__ is not None
    pipe = IterableWrapper([SAMPLE, broken, SAMPLE]).decode(on_error="skip")
    with pytest.warns(SkippedSampleWarning, match="'bad'"):
        assert len(list(pipe)) == 2
    assert pipe.failure_counts() == FailureCounts(skipped=1, samples=1)


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="image"):
        IterableWrapper([]).decode(image="rgb")
    with pytest.raises(ValueError, match="on_error"):
        IterableWrapper([]).decode(on_error=3)


def test_gzipped_fields_are_decoded_by_the_extension_before_gz_as_webdataset_does() -> None:
    sample = {"__key__": "k", "json.gz": gzip.compress(b'{"a": 1}'), "txt.gz": gzip.compress(b"hi"),
              "gz": gzip.compress(b"raw"), "seg.png.gz": gzip.compress(png((4, 5, 6)))}
    (decoded,) = list(IterableWrapper([sample]).decode())
    assert decoded["json.gz"] == {"a": 1} and decoded["txt.gz"] == "hi" and decoded["gz"] == b"raw"
    assert decoded["seg.png.gz"].getpixel((0, 0)) == (4, 5, 6)
    pairs = IterableWrapper([("s.tar/a.cls.gz", gzip.compress(b"3"))])
    assert list(pairs.decode()) == [("s.tar/a.cls.gz", 3)]
    (kept,) = list(IterableWrapper([sample]).decode({"gz": None}))  # switched off: the bytes as they came
    assert kept["json.gz"] == sample["json.gz"]


def test_a_gzipped_field_cut_short_is_named() -> None:
    cut = {"__key__": "bad", "__url__": "shard.tar", "json.gz": gzip.compress(b'{"a": 1}')[:-6]}
    with pytest.raises(SampleDecodeError, match=r"field 'json.gz' of sample 'bad' in 'shard.tar'"):
        list(IterableWrapper([cut]).decode())
