"""The short way for the commonest message: a batch report whose batch is a few small tensors.

A tiny batch's whole trip costs tens of microseconds, and the general codec (``codec.py``) spends
most of its share on pickle machinery around the tensor: our reductions called per tensor, a
global looked up per reduced object, a tensor rebuilt from a storage on arrival. A report whose
batch is one small tensor, or a plain list or tuple of them, takes this path instead: the report's
plain fields and each tensor's layout (dtype, shape) go into one pickle of builtin values
(protocol 5, no custom reduction, no global), and the tensors' bytes follow it, each aligned to 16
bytes. On arrival each tensor is ``torch.frombuffer`` over its bytes in the received buffer.

What the general codec promises, this path keeps: every tensor arrives with a storage of its own
holding exactly its bytes, as a tensor travelling inline does there. Anything else (another
message type, a subclass of Tensor, views of a larger storage, two tensors sharing a storage,
``requires_grad``, anything on a slab) returns None here and goes through the codec; so does
every tensor that is not plain, dense and strided in CPU memory (nested, sparse, quantized,
MKL-DNN, lazily conjugated or negated, zero tensors), which the codec or torch's reductions
carry.

Message layout: ``FLAT_TAG``, the meta pickle's length (4 bytes), the meta pickle, then the
tensors' bytes, each starting at a multiple of 16 from the message start. A pickle (protocol 2 or
later) starts with 0x80, so the first byte tells the two apart.
"""

from __future__ import annotations

import ctypes
import pickle
import struct
from typing import Any

import torch

from pipeload.transport.lease_holders import keep_lease_with
from pipeload.transport.messages import GrantOutcome, Report, WorkerReport

FLAT_TAG = 0xF1
MAX_TENSORS = 16  # beyond this, the batch is not "a few small tensors"
ALIGN = 16
_LENGTH = struct.Struct("<I")
_HEAD = _LENGTH.size + 1
_BATCH = int(Report.BATCH)
_TENSOR, _LIST, _TUPLE = 0, 1, 2
_CONTAINERS = {list: _LIST, tuple: _TUPLE}


def encode_report(report: Any, writer: Any, dtype_index: dict[torch.dtype, int],
                  max_tensor_bytes: int, max_total_bytes: int) -> bytes | None:
    """``report`` as one flat message, or None when it does not qualify (see the module doc).

    ``writer`` is the sender's slab writer (its grant is settled as the codec would settle it);
    ``dtype_index`` numbers the dtypes as the codec does.
    """
    if type(report) is not WorkerReport or report.report is not Report.BATCH:
        return None
    batch = report.payload
    if type(batch) is torch.Tensor:
        container, tensors = _TENSOR, (batch,)
    else:
        container = _CONTAINERS.get(type(batch))
        if container is None or not 0 < len(batch) <= MAX_TENSORS:
            return None
        tensors = batch
    specs = _specs(tensors, dtype_index, max_tensor_bytes, max_total_bytes)
    if specs is None:
        return None
    if writer is not None and (writer.used_bytes or writer.one_shot_bytes):
        return None  # collation put something in shared memory: the codec places it
    outcome = GrantOutcome.NO_GRANT if writer is None else writer.finish()[1]
    meta = pickle.dumps((report.worker_id, report.batch_number, report.totals, report.build_s,
                         report.setup_s, report.finished_at, int(outcome), container, specs),
                        pickle.HIGHEST_PROTOCOL)
    parts = [bytes((FLAT_TAG,)), _LENGTH.pack(len(meta)), meta]
    offset = _HEAD + len(meta)
    for tensor, (_, _, nbytes) in zip(tensors, specs):
        pad = -offset % ALIGN
        parts.append(bytes(pad))
        parts.append(ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b"")
        offset += pad + nbytes
    return b"".join(parts)


def _specs(tensors: Any, dtype_index: dict[torch.dtype, int], max_tensor_bytes: int,
           max_total_bytes: int) -> tuple[tuple[int, tuple[int, ...], int], ...] | None:
    """(dtype number, shape, bytes) per tensor, or None if one of them does not qualify."""
    specs = []
    total = 0
    pointers = set()
    for tensor in tensors:
        # Only a plain dense CPU tensor is described by (dtype, shape, bytes). A nested tensor
        # reports a strided layout but has no single shape (asking for one raises), so it is
        # turned away before anything else is asked; so are sparse, quantized and lazily
        # conjugated or negated tensors, subclasses, and autograd leaves. A zero tensor
        # (``_efficientzerotensor``) has no bytes behind its shape: the size check below
        # turns it away.
        if (type(tensor) is not torch.Tensor or tensor.is_nested or not tensor.is_cpu
                or tensor.requires_grad):
            return None
        torch_dtype = tensor.dtype
        # The conjugate bit exists only on complex tensors; asking a real one costs a call.
        if (tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_neg()
                or (torch_dtype.is_complex and tensor.is_conj())
                or tensor.storage_offset() != 0 or not tensor.is_contiguous()):
            return None
        nbytes = tensor.untyped_storage().nbytes()
        dtype = dtype_index.get(torch_dtype)
        if dtype is None or nbytes > max_tensor_bytes or tensor.nbytes != nbytes:
            return None
        pointer = tensor.data_ptr()
        if nbytes and pointer in pointers:
            return None  # views of one storage must arrive as views of one storage
        pointers.add(pointer)
        total += nbytes
        specs.append((dtype, tuple(tensor.shape), nbytes))
    return tuple(specs) if total <= max_total_bytes else None


def decode_report(payload: bytes | bytearray | memoryview,
                  dtypes: tuple[torch.dtype, ...]) -> tuple[WorkerReport, int]:
    """Rebuild a flat message: (the report, its grant outcome as an int)."""
    if not isinstance(payload, bytearray):
        payload = bytearray(payload)  # frombuffer needs a writable buffer
    (length,) = _LENGTH.unpack_from(payload, 1)
    worker_id, number, totals, build_s, setup_s, finished_at, outcome, container, specs = pickle.loads(
        memoryview(payload)[_HEAD:_HEAD + length])
    offset = _HEAD + length
    tensors = []
    for dtype_number, shape, nbytes in specs:
        offset += -offset % ALIGN
        dtype = dtypes[dtype_number]
        if nbytes:
            flat = torch.frombuffer(payload, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
            # The bytes outlive a move to shared memory (share_memory_), as codec.py's inline ones.
            keep_lease_with(flat.untyped_storage(), payload)
            tensors.append(flat.view(*shape) if shape else flat.view(()))
        else:
            tensors.append(torch.empty(shape, dtype=dtype))
        offset += nbytes
    batch: Any = tensors[0] if container == _TENSOR else (
        tensors if container == _LIST else tuple(tensors))
    report = WorkerReport(Report.BATCH, worker_id, number, batch, totals, build_s, setup_s, finished_at)
    return report, outcome

