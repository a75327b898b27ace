"""A state's digest reads alike the forms JSON and torch.save give a state, and tells apart
every change a damaged state can show."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
import torch

from pipeload._state_digest import check_digest, digest_of, sealed
from pipeload.errors import IncompatibleStateError

STATE: dict[str, Any] = {"count": 5, "flag": True, "ratio": 0.25, "text": "abc", "none": None,
                         "rng": (3, (1, 2, 3), None), "buffer": [[1, 2], {"jpg": b"\xff\xd8", "cls": 3}],
                         "by_worker": {0: {"batches": 2}}}


def test_json_and_torch_save_give_the_same_digest() -> None:
    buffer = io.BytesIO()
    torch.save(STATE, buffer)
    buffer.seek(0)
    kept = torch.load(buffer, weights_only=True)
    as_json = json.loads(json.dumps({**STATE, "buffer": [[1, 2], {"jpg": "x", "cls": 3}]}))
    assert digest_of(kept) == digest_of(STATE)
    assert digest_of(as_json) == digest_of({**STATE, "buffer": [[1, 2], {"jpg": "x", "cls": 3}]})


@pytest.mark.parametrize("changed", [
    {"count": 4}, {"count": 5.0}, {"count": True}, {"count": "5"}, {"flag": 1}, {"ratio": 0.5},
    {"text": "abd"}, {"none": 0}, {"rng": (3, (1, 2, 4), None)}, {"buffer": [[1, 2], {"jpg": b"\xff\xd9", "cls": 3}]},
    {"by_worker": {1: {"batches": 2}}}, {"extra": None},
])
def test_every_change_changes_the_digest(changed: dict[str, Any]) -> None:
    assert digest_of({**STATE, **changed}) != digest_of(STATE)


def test_tensors_and_arrays_count_by_dtype_shape_and_bytes() -> None:
    base = {"t": torch.arange(4), "a": np.arange(4)}
    assert digest_of(base) == digest_of({"t": torch.arange(4), "a": np.arange(4)})
    for other in ({"t": torch.arange(4).float()}, {"t": torch.arange(4).reshape(2, 2)},
                  {"t": torch.tensor([0, 1, 2, 4])}, {"a": np.arange(4, dtype=np.int32)}):
        assert digest_of({**base, **other}) != digest_of(base)


def test_a_sealed_state_checks_and_a_changed_one_is_refused() -> None:
    state = sealed(dict(STATE))
    check_digest(state)
    with pytest.raises(IncompatibleStateError, match="does not match its digest"):
        check_digest({**state, "count": 4})
    with pytest.raises(IncompatibleStateError, match=r"digest should be 'sha256:' and 64 hex digits"):
        check_digest({**state, "digest": state["digest"][:-1]})
