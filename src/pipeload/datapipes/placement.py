"""Where the RFC's ``is_separate_process()`` requests are honoured: process boundaries placed
by the DataLoader, not by the user.

A pipe whose ``is_separate_process()`` returns True asks to run, with everything that feeds
it, in a process of its own. :func:`place_separate_processes` answers with a graph like the
original in which each such pipe is read through a process ``queue_boundary`` placed right
after it. Requests upstream of another request are already answered by that request's process
(it runs everything that feeds it), so only the requests nearest the end of the graph get a
boundary; the others are listed as running there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeload.datapipes.base import is_iter_datapipe, pipe_label
from pipeload.datapipes.graph import list_dps, replaced_in_a_copy

SEPARATE_PROCESS_BUFFER = 8  # items a placed boundary holds, as queue_boundary's default


@dataclass(frozen=True)
class Placement:
    """One answered request.

    Attributes:
        pipe: the requesting pipe's name (its repr).
        where: in words: "its own process (a process boundary after it)", "the process of
            Batcher's boundary".
    """

    pipe: str
    where: str

    def __str__(self) -> str:
        return f"{self.pipe}: {self.where}"


def asks_for_own_process(datapipe: Any) -> bool:
    """Whether ``datapipe`` answers True to the RFC's ``is_separate_process()``."""
    ask = getattr(datapipe, "is_separate_process", None)
    return callable(ask) and bool(ask())


def requests_in(datapipe: Any) -> list[Any]:
    """The pipes of the graph that ask for a process of their own, in graph order."""
    return [dp for dp in list_dps(datapipe) if asks_for_own_process(dp)]


def place_separate_processes(datapipe: Any, multiprocessing_context: Any = None) -> tuple[Any, list[Placement]]:
    """A graph like ``datapipe``'s with a process boundary after each pipe that asks for its own
    process (see the module doc), and what was placed where. The original graph is unchanged.

    Args:
        datapipe: the graph's last pipe.
        multiprocessing_context: the boundaries' start method (None: multiprocessing's default).

    Returns:
        ``(graph, placements)``; ``graph`` is ``datapipe`` itself when nothing asks.

    Raises:
        TypeError: a map-style pipe asks (boundaries carry iterable pipes only).

    Example:
        >>> class Decode(IterDataPipe):
        ...     def is_separate_process(self): return True
        ...     ...
        >>> placed, where = place_separate_processes(Decode(files).batch(8))
        >>> [str(p) for p in where]
        ['Decode: its own process (a process boundary after it)']
    """
    from pipeload.datapipes.boundary.pipes import QueueBoundary

    requests = requests_in(datapipe)
    if not requests:
        return datapipe, []
    outermost = _outermost(requests)
    placements = []
    placed = datapipe
    for request in requests:
        if not is_iter_datapipe(request):
            raise TypeError(
                f"{request!r} asks for a process of its own (is_separate_process() is True), but "
                "only iterable-style pipes can run behind a process boundary"
            )
        if any(request is r for r in outermost):
            boundary = QueueBoundary(request, "process", SEPARATE_PROCESS_BUFFER, multiprocessing_context)
            placed = replaced_in_a_copy(placed, request, boundary) if request is not datapipe else boundary
            placements.append(Placement(pipe_label(request), "its own process (a process boundary after it)"))
        else:
            host = next(r for r in outermost if any(dp is request for dp in list_dps(r)))
            placements.append(Placement(pipe_label(request), f"the process of {pipe_label(host)}, which it feeds"))
    return placed, placements


def _outermost(requests: list[Any]) -> list[Any]:
    """The requests that no other request reads from, directly or not."""
    upstream_of_others = set()
    for request in requests:
        for dp in list_dps(request)[1:]:
            upstream_of_others.add(id(dp))
    return [r for r in requests if id(r) not in upstream_of_others]
