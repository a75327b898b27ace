"""The checkpoint fuzz, one level down: damaged pipe states loaded straight into pipes.

``test_damaged_state_fuzz.py`` damages the loader's state, whose digest sees nearly everything.
A pipe's own ``state_dict()`` kept by hand, or the replicas of a version-1 loader state, carry no
digest: there the pipes' own checks are all there is. Real states of every built-in pipe that
keeps one (an in-memory source, shuffle, batch, unbatch, header, enumerate, sharding, cycle,
concat, flatmap, in-batch shuffle, a map-style shuffle read as an iterable, tar shards listed from
a directory) are damaged by the same generator (``state_damage``) and loaded into a fresh iterator
of the same graph. Each one must be

- refused with ``IncompatibleStateError``, the iterator left as it was (it then yields what a
  fresh one yields), or
- accepted, and then run to its end without an error: damage that is well-formed (a bit flipped
  in a count, an item of a buffer changed or dropped) cannot be told from a real state without a
  digest, but it must not fail from deep inside either. Two exceptions, by necessity: a tar offset
  moved to another block boundary inside a member is refused by the archive when it is read there
  (its header fails the checksum), as an ``ArchiveError`` naming that byte; and a tar checkpoint
  whose archive URL or version (length, content digest) or whose source's position (which then
  opens another archive) changed in a well-formed way is refused when the archive is opened, as a
  ``SourceChangedError`` saying what differs: it cannot be told from a replaced archive.

A value of another type (``5.0`` or ``"5"`` for a count, a dict for a list, ``1`` for a flag) is
never accepted where the pipe reads it (data items inside a buffer are the pipe's to carry, not to
judge). ``PIPELOAD_FUZZ_SEED`` picks other damages.
"""

from __future__ import annotations

import copy
import io
import itertools
import os
import random
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from state_damage import damaged, try_load

from pipeload.datapipes.sources.errors import ArchiveError, SourceChangedError
from pipeload.datapipes.iter import FileLister, IterableWrapper
from pipeload.datapipes.map import SequenceWrapper

DAMAGES = 600
SEED = int(os.environ.get("PIPELOAD_FUZZ_SEED", "0"))
RUN_LIMIT = 500  # items read from an accepted state's run: every graph here ends well before


def texts(count: int) -> list[str]:
    return [f"item-{i}" for i in range(count)]


def words(text: str) -> list[str]:
    return text.split()


def member_text(member: tuple[str, bytes]) -> str:
    return member[1].decode()


# name -> (the graph, items taken before the checkpoint); each graph is seeded, so runs repeat
GRAPHS: dict[str, tuple[Callable[[Path], Any], int]] = {
    "shuffle-batch": (lambda _: IterableWrapper(texts(40)).shuffle(buffer_size=6).set_seed(3)
                      .map(repr).batch(3), 4),  # repr: damaged data is still data
    "cycle-enumerate-header-shard": (lambda _: IterableWrapper(texts(7)).cycle(3)
                                     .enumerate(starting_index=5).header(18).sharding_filter(), 3),
    "batch-in-batch-shuffle-unbatch": (lambda _: IterableWrapper(texts(30)).batch(4)
                                       .in_batch_shuffle().set_seed(2).unbatch(), 6),
    "concat-flatmap": (lambda _: IterableWrapper(["a b", "c d e"]).flatmap(words)
                       .concat(IterableWrapper(["f g h", "i"]).flatmap(words)), 6),
    "map-shuffle-as-iterable": (lambda _: IterableWrapper(SequenceWrapper(texts(12)).shuffle().set_seed(4))
                                .batch(2), 2),
    "tar-shards-listed": (lambda root: FileLister(str(root), "*.tar").open_files("b").load_from_tar()
                          .map(member_text), 4),
}


def write_shards(root: Path) -> None:
    for number, size in enumerate((3, 4)):
        with tarfile.open(root / f"shard-{number}.tar", "w") as archive:
            for item in range(size):
                data = f"{number}-{item}".encode()
                info = tarfile.TarInfo(f"{number:02d}{item:02d}.txt")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def run(iterator: Any) -> list[Any]:
    return list(itertools.islice(iterator, RUN_LIMIT))


def original_at(state: Any, what: str) -> Any:
    """The value a damage (``"swap type at upstream.0.own -> '5'"``) replaced."""
    value = state
    for key in what.split(" at ", 1)[1].split(" -> ")[0].split("."):
        value = value[int(key)] if isinstance(value, (list, tuple)) else value[key]
    return value


def retyped_count_or_flag(state: Any, what: str) -> bool:
    """A count, an index, a generator word or a flag swapped for a value of another type. The
    data here are all text, so every int or bool in a state is one the pipe reads itself."""
    return what.startswith("swap type") and type(original_at(state, what)) in (int, bool)


def points_into_a_member(state: Any, error: ArchiveError) -> bool:
    """A tar offset on a block boundary but inside a member's data: a well-formed value that only
    the archive can refuse, when it is read at that offset (the header there fails its checksum),
    with an error naming the byte. The one accepted state allowed to fail later, and only so."""
    offset = state["upstream"][0]["own"][0] if isinstance(state["upstream"][0].get("own"), list) else None
    return (offset is not None and f"the header at byte {offset} is not a valid tar header" in str(error))


def damaged_archive_version(what: str) -> bool:
    """A damage of the archive URL or version a tar checkpoint keeps (``upstream.0.own.2``,
    ``.3``) or of the position of the source feeding it (``upstream.0.upstream``, which opens
    another archive): well-formed, it reads as a replaced archive when the archive is opened, a
    SourceChangedError saying what differs."""
    return any(f" at upstream.0.{place}" in what for place in ("own.2", "own.3", "upstream."))


def fuzz(make: Callable[[], Any], taken: int, count: int, seed: int) -> tuple[int, list[str]]:
    iterator = iter(make())
    for _ in range(taken):
        next(iterator)
    state = copy.deepcopy(iterator.state_dict())
    fresh = run(iter(make()))
    rng = random.Random(seed)
    accepted, failures = 0, []
    for _ in range(count):
        what, bad = damaged(state, rng)
        target = iter(make())
        loaded, failure = try_load(lambda: target.load_state_dict(bad), what, lambda: run(target) == fresh)
        if failure:
            failures.append(failure)
        if not loaded:
            continue
        accepted += 1
        if retyped_count_or_flag(state, what):
            failures.append(f"{what}: a value of another type was accepted")
        try:
            run(target)
        except SourceChangedError as error:
            if not damaged_archive_version(what):
                failures.append(f"{what}: accepted, then {type(error).__name__}: {error}"[:300])
        except ArchiveError as error:
            if not points_into_a_member(bad, error):
                failures.append(f"{what}: accepted, then {type(error).__name__}: {error}"[:300])
        except Exception as error:  # noqa: BLE001 - accepted, then failing from deep inside
            failures.append(f"{what}: accepted, then {type(error).__name__}: {error}"[:300])
    return accepted, failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GRAPHS)
def test_a_damaged_pipe_state_is_refused_or_runs(name: str, tmp_path: Path) -> None:
    build, taken = GRAPHS[name]
    write_shards(tmp_path)
    per_graph = -(-DAMAGES // len(GRAPHS))
    seed = SEED * 1000 + list(GRAPHS).index(name)
    accepted, failures = fuzz(lambda: build(tmp_path), taken, per_graph, seed)
    assert not failures, f"{len(failures)} of {per_graph} damaged states (seed {seed}):\n" + "\n".join(failures[:10])
    # well-formed damage of the data a buffer or batch carries is accepted (up to half, for the
    # shuffle's six items and its generator's words); the rest of the damage is seen
    assert accepted <= per_graph * 2 // 3
