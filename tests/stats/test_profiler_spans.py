"""Loading stages appear in torch.profiler traces (CPU), as torch's loader's __next__ does.

torch's profiler records the threads of the process that started it, through thread-local
callbacks, so it sees the training loop's thread: ``__next__`` always, and the fetch and collate
spans when they run there (num_workers=0). Worker threads and processes open their spans too,
for a profiler running in them.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import pipeload

SPANS = {"pipeload.DataLoader.__next__", "pipeload.fetch", "pipeload.collate"}


@pytest.mark.parametrize("engine", [{"num_workers": 0}, {"num_workers": 2, "worker_type": "thread"},
                                    {"num_workers": 1, "worker_type": "thread", "mode": "economic"}],
                         ids=["inline", "thread", "economic-thread"])
def test_stages_are_spans_in_a_cpu_trace(engine: dict) -> None:
    loader = pipeload.DataLoader(torch.arange(32.0), batch_size=4, **engine)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        assert len(list(loader)) == 8
    names = {event.key for event in trace.key_averages()}
    expected = SPANS if engine["num_workers"] == 0 else {"pipeload.DataLoader.__next__"}
    assert expected <= names, sorted(names)
    nexts = [e for e in trace.key_averages() if e.key == "pipeload.DataLoader.__next__"]
    assert nexts[0].count == 9  # eight batches, then the call that ends the epoch


def test_no_spans_without_a_profiler_and_nothing_recorded_after_it() -> None:
    loader = pipeload.DataLoader(torch.arange(8.0), batch_size=4)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        pass
    list(loader)
    assert not any(e.key.startswith("pipeload.") for e in trace.key_averages())

