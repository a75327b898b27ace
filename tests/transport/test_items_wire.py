"""The items wire: an economic item worker's ITEMS_DONE whose groups are columns skips the codec's
pickle machinery and arrives exactly as the codec would deliver it; every other report still
takes the codec."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from pipeload.errors import RemoteFailure
from pipeload.transport.codec import decode, encode
from pipeload.transport.item_columns import ItemColumns, TensorField
from pipeload.transport.items_wire import ITEMS_TAG
from pipeload.transport.messages import GrantOutcome, ItemsDone, Report, WorkerReport

TOTALS = (3, 192, 0.5, 0.25, 0.125, 1536, 12.0, 0.75, 0.0, 0)


def _columns(kind: str = "tuple", keys: tuple[str, ...] | None = None) -> ItemColumns:
    fields = (TensorField(torch.bfloat16, (3, 4)), int, float, bool, str)
    values = (None, [7, 8], [0.5, 1.5], [True, False], ["a/1.jpg", "é/2.jpg"])
    return ItemColumns(kind, keys, fields, values, 2)


def _report(done: ItemsDone, totals=None) -> WorkerReport:
    return WorkerReport(Report.ITEMS_DONE, 3, 41, done, totals, 0.0, 0.0, 812.25)


def test_a_timed_piece_carries_its_totals_on_the_items_wire() -> None:
    report = _report(ItemsDone(2, None, True, ((0, 2, _columns()),), GrantOutcome.USED), totals=TOTALS)
    received, short = _round_trip(report)
    assert short and received == report and received.totals == TOTALS


def _round_trip(report: WorkerReport) -> tuple[WorkerReport, bool]:
    payload, fds, keep_alive = encode(report, None)
    short = payload[0] == ITEMS_TAG
    received, _ = decode(bytearray(payload), [os.dup(fd) for fd in fds], None)
    del keep_alive
    return received, short


@pytest.mark.parametrize("done", [
    ItemsDone(4, (1_024, 96), True, ((0, 2, _columns()), (2, 2, _columns())), GrantOutcome.USED),
    ItemsDone(2, None, None, ((6, 2, _columns("dict", ("image", "label", "weight", "flip", "path"))),),
              GrantOutcome.LATE),
    ItemsDone(16, (49_152,), None),  # a piece handed to a batch worker: no groups
    ItemsDone(16, None, False),
])
def test_a_report_of_columns_arrives_equal_on_the_items_wire(done: ItemsDone) -> None:
    received, short = _round_trip(_report(done))
    assert short
    assert received == _report(done)
    assert received.payload.outcome is done.outcome and received.report is Report.ITEMS_DONE
    for (_, _, ours), (_, _, theirs) in zip(received.payload.groups or (), done.groups or ()):
        assert [type(field) for field in ours.fields] == [type(field) for field in theirs.fields]
        assert ours.layout == theirs.layout and ours.values == theirs.values


def _failure() -> RemoteFailure:
    try:
        raise KeyError("no item 5")
    except KeyError:
        return RemoteFailure.capture(0, "fetching items", [5])


@pytest.mark.parametrize("report", [
    _report(ItemsDone(2, None, None, ((0, 2, [(torch.zeros(2), 1), (torch.ones(2), 2)]),))),  # samples
    _report(ItemsDone(2, None, None, ((0, 2, _failure()),))),
    WorkerReport(Report.EPOCH_STARTED, 0, 3, "item"),
])
def test_anything_else_takes_the_codec_and_arrives_as_it_did(report: WorkerReport) -> None:
    received, short = _round_trip(report)
    assert not short
    assert received.report is report.report and received.totals == report.totals
    done = received.payload
    if isinstance(done, ItemsDone):
        payload = done.groups[0][2]
        sent = report.payload.groups[0][2]
        if isinstance(sent, list):
            assert [int(label) for _, label in payload] == [1, 2]
            assert torch.equal(payload[1][0], torch.ones(2))
        else:
            assert type(payload) is type(sent)


def test_the_items_wire_pickles_no_global() -> None:
    payload, _, _ = encode(_report(ItemsDone(4, (1_024, 96), True, ((0, 2, _columns()),), GrantOutcome.USED)), None)
    globals_used = [op for op, _, _ in __import__("pickletools").genops(bytes(payload[1:]))
                    if op.name in ("GLOBAL", "STACK_GLOBAL", "REDUCE")]
    assert globals_used == []
    assert pickle.loads(bytes(payload[1:]))[1] == 41  # a plain pickle after the tag
