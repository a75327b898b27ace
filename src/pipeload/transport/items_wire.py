"""The short way for economic mode's commonest report: an item worker's ``ITEMS_DONE`` whose items
are already at their places in the batch's slab.

Each item worker sends one such report a piece, and the main process, which every batch waits for,
reads every one of them. Through the general codec (``codec.py``) its classes are looked up by
name and rebuilt by their reductions (the report, ``ItemsDone``, each ``ItemColumns`` and
``TensorField``, a dtype, two enums): on ``pipeload bench``'s JPEGs that took an item worker about
6 us an item and the main process tens of microseconds a report, woken with cold caches. A report
whose groups are all columns (``transport/item_columns.py``: their tensors are in the slab, the
rest are plain ints, floats, bools and strings) takes this path instead: its fields go into one
pickle of builtin values (no global, no reduction), dtypes as the codec numbers them, field types
by position in ``SCALAR_TYPES``, a timed piece's stats totals as the plain tuple they are.
Anything else (samples, a failure) returns None here and goes through the codec.

Message layout: ``ITEMS_TAG``, then the pickle. A pickle (protocol 2 or later) starts with 0x80
and a flat batch with ``flat_wire.FLAT_TAG``, so the first byte tells the three apart.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from pipeload.transport.item_columns import ItemColumns, TensorField
from pipeload.transport.messages import GRANT_OUTCOMES, GrantOutcome, ItemsDone, Report, WorkerReport

ITEMS_TAG = 0xF2
SCALAR_TYPES = (int, float, bool, str)  # what a column of values may hold (item_columns._SCALARS)
_SCALAR_INDEX = {kind: index for index, kind in enumerate(SCALAR_TYPES)}


def encode_report(report: Any, writer: Any, dtype_index: dict[torch.dtype, int]) -> bytes | None:
    """``report`` as one plain message, or None when it does not qualify (see the module doc).

    ``writer`` is the sender's slab writer (its grant, if any, settled as the codec would);
    ``dtype_index`` numbers the dtypes as the codec does.
    """
    if type(report) is not WorkerReport or report.report is not Report.ITEMS_DONE:
        return None
    done = report.payload
    if type(done) is not ItemsDone:
        return None
    groups = None
    if done.groups is not None:
        groups = []
        for slot, count, payload in done.groups:
            if type(payload) is not ItemColumns:
                return None
            fields = _plain_fields(payload.fields, dtype_index)
            if fields is None:
                return None
            groups.append((slot, count, payload.kind, payload.keys, fields, payload.values, payload.count))
    if writer is not None and (writer.used_bytes or writer.one_shot_bytes):
        return None  # the report put something in shared memory: the codec says where
    outcome = GrantOutcome.NO_GRANT if writer is None else writer.finish()[1]
    body = (report.worker_id, report.batch_number, report.totals, report.build_s, report.setup_s,
            report.finished_at, int(outcome), done.count, done.item_bytes, done.as_columns, groups,
            None if done.outcome is None else int(done.outcome))
    return bytes((ITEMS_TAG,)) + pickle.dumps(body, pickle.HIGHEST_PROTOCOL)


def decode_report(payload: bytes | bytearray | memoryview,
                  dtypes: tuple[torch.dtype, ...]) -> tuple[WorkerReport, int]:
    """Rebuild a message made by :func:`encode_report`: (the report, its grant outcome as an int)."""
    (worker_id, number, totals, build_s, setup_s, finished_at, outcome, count, item_bytes, as_columns,
     groups, done_outcome) = pickle.loads(memoryview(payload)[1:])
    if groups is not None:
        groups = tuple((slot, items, ItemColumns(kind, keys, _fields(fields, dtypes), values, columns))
                       for slot, items, kind, keys, fields, values, columns in groups)
    done = ItemsDone(count, item_bytes, as_columns, groups,
                     None if done_outcome is None else GRANT_OUTCOMES[done_outcome])
    return WorkerReport(Report.ITEMS_DONE, worker_id, number, done, totals, build_s, setup_s, finished_at), outcome


def _plain_fields(fields: tuple[Any, ...], dtype_index: dict[torch.dtype, int]) -> tuple[Any, ...] | None:
    """Each field as builtins: (dtype number, shape) for a tensor field, the scalar type's number
    for any other; None if one of them has no number."""
    plain = []
    for field in fields:
        if type(field) is TensorField:
            dtype = dtype_index.get(field.dtype)
            if dtype is None:
                return None
            plain.append((dtype, field.shape))
        else:
            kind = _SCALAR_INDEX.get(field)
            if kind is None:
                return None
            plain.append(kind)
    return tuple(plain)


def _fields(plain: tuple[Any, ...], dtypes: tuple[torch.dtype, ...]) -> tuple[Any, ...]:
    return tuple(TensorField(dtypes[field[0]], field[1]) if type(field) is tuple else SCALAR_TYPES[field]
                 for field in plain)
