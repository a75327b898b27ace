"""A replica's state written so that JSON gives it back as it was (resume/faithful.py)."""

from __future__ import annotations

import collections
import io
import json

import torch

from pipeload.resume.faithful import read_back, written

Point = collections.namedtuple("Point", "x y")

SAMPLES = [
    {0: 1, 1: (2, -2), (3, "x"): [None, 1.5], "text": {"inner": (4,)}},
    ((), [()], {}, {"pipeload:tuple": [1]}, {"pipeload:pairs": 5}),
    [1, "a", None, True, 2.5, [(1, 2), {3: 4}]],
]


def test_json_gives_back_tuples_and_keys_of_every_type_as_they_were() -> None:
    for sample in SAMPLES:
        back = read_back(json.loads(json.dumps(written(sample))))
        assert back == sample and repr(back) == repr(sample)


def test_torch_save_gives_them_back_too_and_keeps_what_it_keeps() -> None:
    point = Point(1, 2)  # left as it is: torch.save keeps it
    sample = {"p": point, 0: (torch.arange(3),)}
    buffer = io.BytesIO()
    torch.save(written(sample), buffer)
    buffer.seek(0)
    back = read_back(torch.load(buffer, weights_only=False))
    assert type(back["p"]) is type(point) and back["p"] == point
    assert type(back[0]) is tuple and torch.equal(back[0][0], torch.arange(3))


def test_plain_json_data_is_written_as_it_is() -> None:
    plain = {"a": [1, 2, {"b": None}], "c": "d"}
    assert written(plain) == plain and read_back(plain) == plain


def test_subclasses_that_torch_save_keeps_are_given_back_untouched() -> None:
    # Rebuilt as plain dicts, a resumed defaultdict raised KeyError.
    sample = {"counts": collections.defaultdict(int, {"a": 1}), "order": collections.OrderedDict(b=2),
              "seen": collections.Counter("aab")}
    buffer = io.BytesIO()
    torch.save(written(sample), buffer)
    buffer.seek(0)
    back = read_back(torch.load(buffer, weights_only=False))
    assert back == sample
    assert type(back["order"]) is collections.OrderedDict and type(back["seen"]) is collections.Counter
    assert type(back["counts"]) is collections.defaultdict and back["counts"]["missing"] == 0
