"""Random generator states as JSON-friendly text, and borrowing torch's global generator.

A checkpoint must be plain JSON, so a ``torch.Generator`` state (a ByteTensor of about 5 KB) is
kept as base64 text. Replaying draws that were made from torch's *global* generator must not
disturb the user's own stream: :func:`borrowed_global_rng` sets the global generator to a recorded
state for a moment and gives the user's state back afterwards.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def encode_state(state: torch.Tensor) -> str:
    """A generator state (``get_state()`` / ``get_rng_state()``) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_state(text: str) -> torch.Tensor:
    """The ByteTensor that :func:`encode_state` encoded."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def checked_state(text: object) -> torch.Tensor:
    """The generator state ``text`` encodes, refused unless a CPU generator would take it.

    Raises:
        ValueError: not text, not base64, or not a CPU generator's state (torch's reason, say
            "Expected a CPUGeneratorImplState of size 5056 ..." for a truncated one).
    """
    if not isinstance(text, str):
        raise ValueError(f"not text but {type(text).__name__}")
    try:
        # validate=True: the lenient decoder drops stray characters, hiding a damaged text
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as error:
        raise ValueError(f"not base64 text: {error}") from None
    state = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    try:
        torch.Generator().set_state(state)  # a throwaway one: torch checks the size and the words
    except RuntimeError as error:
        raise ValueError(str(error).strip()) from None
    return state


def generator_state(generator: torch.Generator | None) -> str:
    """The state of ``generator`` (torch's global CPU generator when None), encoded."""
    if generator is None:
        return encode_state(torch.get_rng_state())
    return encode_state(generator.get_state())


def set_generator_state(generator: torch.Generator | None, text: str) -> None:
    """Set ``generator`` (the global one when None) to an encoded state."""
    if generator is None:
        torch.set_rng_state(decode_state(text))
    else:
        generator.set_state(decode_state(text))


@contextlib.contextmanager
def borrowed_global_rng(state: str | torch.Tensor | None) -> Iterator[None]:
    """Draw from torch's global generator as it was at a recorded state (encoded, or the
    tensor itself), then give it back. ``None`` borrows nothing (the block draws from the global
    generator as it is)."""
    if state is None:
        yield
        return
    saved = torch.get_rng_state()
    torch.set_rng_state(decode_state(state) if isinstance(state, str) else state)
    try:
        yield
    finally:
        torch.set_rng_state(saved)


@contextlib.contextmanager
def global_rngs_kept() -> Iterator[None]:
    """Run the block, then put the process's global generators (torch's, Python's ``random``,
    numpy's) back as they were before it."""
    states = random.getstate(), torch.get_rng_state(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        np.random.set_state(states[2])
