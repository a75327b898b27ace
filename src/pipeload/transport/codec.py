"""Turning a batch into one message and back: small tensors inside it, large ones in shared memory.

The message is a pickle with our own reductions for CPU tensors and storages. A plain tensor
becomes its layout (dtype, shape, strides, offset) and a reference to its storage; everything that
is not a tensor (numbers, strings, custom objects) is pickled as usual. Each storage is placed once,
whatever the number of tensors viewing it, in the first way that applies:

1. the slab granted for this message, when collation already wrote it there: no copy at all;
   each output arrives over its own piece of the slab (the room it was written into), a storage
   of its size as torch's outputs have, not a view of the whole slab;
2. inline, when it is at most ``INLINE_MAX_BYTES`` (and the message's inline budget allows): its
   bytes ride inside the message, which beats any shared-memory set-up for small batches;
3. its own descriptor, when it already lives in descriptor-backed shared memory;
4. copied into the rest of the granted slab, when there is room;
5. copied into a fresh one-shot buffer, whose descriptor rides along (SCM_RIGHTS).

A large message with no slab granted, from a producer that offers its buffers (a classic worker,
see slab_writer.py), is written into a buffer of its own laid out as a slab: 1 and 4 then apply to
that buffer, named in the message by its descriptor (a negative slab reference, ``_slab_ref``),
and the consumer's pool may take it over as a slab (``SlabPool.adopt``).

A batch report whose batch is one small tensor, or a plain list or tuple of a few, skips all of
this and takes ``flat_wire.py``, which delivers it the same way for a fraction of the cost.

The consumer views slab storages through the message's lease (see slab_pool.py) and maps
descriptors; a trailer after the pickle says how many bytes the batch needed outside the message
and what became of the grant, so the owner can size slabs and settle the grant.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import math
import mmap
import os
import pickle
import struct
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions, used for the rest)
from torch.multiprocessing.reductions import reduce_storage as _torch_reduce_storage
from torch.multiprocessing.reductions import reduce_tensor as _torch_reduce_tensor

from pipeload.errors import SharedMemoryError, TooManyOpenFilesError, cannot_map_message, too_many_open_files
from pipeload.transport import flat_wire, items_wire
from pipeload.transport.fd_passing import DESCRIPTORS_PER_KEPT_BATCH, descriptor_table_full
from pipeload.transport.lease_holders import keep_lease_with
from pipeload.transport.messages import GRANT_OUTCOMES, GrantOutcome
from pipeload.transport.shared_memory import note_received, storage_from_descriptor
from pipeload.transport.slab_writer import SlabWriter, one_shot_storage

INLINE_MAX_BYTES = 64 * 1024
INLINE_BUDGET_BYTES = 1 << 20
_TRAILER = struct.Struct("<QB")
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(_DTYPES)}
# The reports that skip this codec, by their first byte (a pickle's is 0x80).
_SHORT_WIRES = {flat_wire.FLAT_TAG: flat_wire, items_wire.ITEMS_TAG: items_wire}


class Placement:
    """How one storage travels (an int tag in the message)."""

    CACHED = 0  # already placed earlier in this message
    SLAB = 1
    REGION = 2
    INLINE = 3
    DESCRIPTOR = 4


@dataclass(frozen=True)
class MessageInfo:
    """What the consumer learns about a message besides its content."""

    shared_bytes: int = 0
    """Bytes the batch needed outside the message (slab and one-shot buffers)."""
    outcome: GrantOutcome = GrantOutcome.NO_GRANT


NO_INFO = MessageInfo()


# -- encoding (producer side) ---------------------------------------------------------------


class _Outgoing(threading.local):
    """Per-message state of the encoder, for the thread encoding it."""

    writer: SlabWriter | None = None
    fds: list[int] = []
    keep_alive: list[Any] = []
    slots: dict[tuple[int, int], int] = {}
    inline_left = 0
    offer_ref: int | None = None  # the offered buffer's name in the message, once passed


_outgoing = _Outgoing()


def encode(obj: Any, writer: SlabWriter | None) -> tuple[memoryview, list[int], list[Any]]:
    """Pickle ``obj`` into one message.

    Returns the bytes, the descriptors to pass with them, and the objects that keep those
    descriptors valid until the message is sent.
    """
    flat = flat_wire.encode_report(obj, writer, _DTYPE_INDEX, INLINE_MAX_BYTES, INLINE_BUDGET_BYTES)
    if flat is None:
        flat = items_wire.encode_report(obj, writer, _DTYPE_INDEX)
    if flat is not None:
        return memoryview(flat), [], []
    out = _outgoing
    out.writer, out.fds, out.keep_alive, out.slots = writer, [], [], {}
    out.inline_left, out.offer_ref = INLINE_BUDGET_BYTES, None
    buffer = io.BytesIO()
    try:
        pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = _dispatch_table()
        pickler.dump(obj)
        shared, outcome = (0, GrantOutcome.NO_GRANT) if writer is None else writer.finish()
        buffer.write(_TRAILER.pack(shared, outcome))
        return buffer.getbuffer(), out.fds, out.keep_alive
    finally:
        out.writer, out.fds, out.keep_alive, out.slots = None, [], [], {}


_table_cache: dict[str, Any] = {"size": -1, "table": {}}


def _dispatch_table() -> dict[Any, Any]:
    """copyreg's and multiprocessing's reductions (torch's among them), and ours on top."""
    size = len(copyreg.dispatch_table) + len(ForkingPickler._extra_reducers)
    if _table_cache["size"] != size:
        table = dict(copyreg.dispatch_table)
        table.update(ForkingPickler._extra_reducers)
        table[torch.Tensor] = _reduce_tensor
        table[np.ndarray] = _reduce_ndarray
        table[torch.UntypedStorage] = _reduce_storage
        table[_SlabPiece] = _reduce_piece
        _table_cache.update(size=size, table=table)
    return _table_cache["table"]


def _reduce_ndarray(array: np.ndarray) -> Any:
    """A numpy array as torch's worker queue sends it (pickle's protocol 4): arriving writable
    and in the machine's byte order. Protocol 5, this message's, kept a read-only array
    (``np.frombuffer`` of bytes, which a dataset decoding files often returns) read-only and a
    big-endian one big-endian: an in-place update, or ``torch.from_numpy``, that works on what
    torch's workers hand over failed (a skeptic's probe at stop 53). Only those take protocol 4,
    whose copy made a 100 MB array's encoding 3x slower; any other arrives the same either way."""
    return array.__reduce_ex__(5 if array.flags.writeable and array.dtype.isnative else 4)


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    # A nested tensor answers ``layout`` with strided but has no single shape or storage view:
    # it must be asked first, and torch's reduction carries it.
    if tensor.is_quantized and tensor.is_cpu and tensor.qscheme() in _QUANTIZED_SCHEMES:
        return _reduce_quantized(tensor)
    if (tensor.is_nested or not tensor.is_cpu or tensor.requires_grad
            or tensor.layout is not torch.strided or tensor.is_quantized):
        return _torch_reduce_tensor(tensor)  # torch's path keeps autograd and exotic layouts
    if tensor._is_zerotensor():
        # A zero tensor has a shape but no bytes behind it (torch's reduction crashes on it):
        # it travels as the zeros it stands for.
        tensor = torch.zeros(tensor.shape, dtype=tensor.dtype)
    if tensor.is_conj() or tensor.is_neg():
        # A lazy conjugate/negation is a bit on the tensor, not in its storage: apply it (a
        # copy), or the values would arrive unconjugated.
        tensor = tensor.resolve_conj().resolve_neg()
    writer = _outgoing.writer
    if writer is not None and writer.carries_items and (placed := _placed_item(tensor, writer)):
        return placed
    storage = tensor.untyped_storage()
    dtype_index = _DTYPE_INDEX[tensor.dtype]
    shape = tuple(tensor.shape)
    if writer is not None and writer.owns(storage) and (piece := _piece_of_slab(tensor, writer)):
        offset, nbytes = piece
        return (_rebuild_tensor, (_SlabPiece(offset, nbytes), dtype_index, shape, tensor.stride(),
                                  tensor.storage_offset() - offset // tensor.element_size()))
    if writer is not None and writer.maps_other_slab(storage):
        # Kept by user code from an earlier batch (a collate returning its last output): its
        # storage is that whole slab, which would travel whole, and the next slab, sized to fit
        # it, whole again with the next batch: slabs grew by a slab a batch. Its own bytes go.
        tensor = tensor.clone()
        storage = tensor.untyped_storage()
    inline = _whole_inline_tensor(tensor, storage)
    if inline is not None:
        return (_inline_tensor, (inline[0], inline[1], dtype_index, shape))
    return (_rebuild_tensor, (storage, dtype_index, shape, tensor.stride(),
                              tensor.storage_offset()))


class _SlabPiece:
    """A piece of the granted slab that one output (or a run of rows) was written into, standing
    for the tensor's storage in the message: it arrives as a storage of exactly that piece."""

    __slots__ = ("offset", "nbytes")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset = offset
        self.nbytes = nbytes


def _piece_of_slab(tensor: torch.Tensor, writer: SlabWriter) -> tuple[int, int] | None:
    """The piece of the slab (``SlabWriter.region_of``) holding every byte ``tensor`` views."""
    if tensor.numel() == 0:
        return None
    itemsize = tensor.element_size()
    start = tensor.storage_offset() * itemsize
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return writer.region_of(start, start + (last + 1) * itemsize)


def _reduce_piece(piece: _SlabPiece) -> Any:
    out = _outgoing
    writer = out.writer
    key = (writer.slab_storage().data_ptr() + piece.offset, piece.nbytes)
    slot = out.slots.get(key)
    if slot is not None:
        return (_storage_at, (slot, Placement.CACHED, None))
    slot = out.slots[key] = len(out.slots)
    return (_storage_at, (slot, Placement.REGION, (_slab_ref(out), piece.offset, piece.nbytes)))


def _slab_ref(out: _Outgoing) -> int:
    """How the message names the slab its writer writes into: the granted slab's id, or, for a
    buffer the writer offers (``SlabWriter.offers_buffers``), -1 - the index of its descriptor,
    which travels once with the message."""
    writer = out.writer
    if not writer.offering:
        return writer.slab_id
    if out.offer_ref is None:
        out.fds.append(writer.offered_descriptor())
        out.offer_ref = -len(out.fds)
    return out.offer_ref


_QUANTIZED_SCHEMES = (torch.per_tensor_affine, torch.per_channel_affine,
                      torch.per_channel_affine_float_qparams)


def _reduce_quantized(tensor: torch.Tensor) -> Any:
    """A quantized tensor as its bytes and its quantizer's parameters.

    torch's reduction rebuilds one from its storage alone, without a quantizer: it arrives with
    its dtype but cannot be read. Here its bytes (made contiguous, offset 0) travel as a plain
    uint8 tensor, placed like any other, and the receiver makes an empty quantized tensor with
    the same parameters and copies them in. Strides are not kept (torch keeps nothing).
    """
    dense = tensor.clone(memory_format=torch.contiguous_format)
    data = _byte_view(dense.untyped_storage())
    scheme = tensor.qscheme()
    if scheme is torch.per_tensor_affine:
        params = (tensor.q_scale(), tensor.q_zero_point())
    else:
        params = (tensor.q_per_channel_scales(), tensor.q_per_channel_zero_points(),
                  tensor.q_per_channel_axis())
    return (_rebuild_quantized, (data, _DTYPE_INDEX[tensor.dtype], tuple(tensor.shape), params))


def _rebuild_quantized(data: torch.Tensor, dtype_index: int, shape: tuple[int, ...],
                       params: tuple[Any, ...]) -> torch.Tensor:
    dtype = _DTYPES[dtype_index]
    if len(params) == 2:
        tensor = torch._empty_affine_quantized(shape, scale=params[0], zero_point=params[1], dtype=dtype)
    else:
        scales, zero_points, axis = params
        tensor = torch._empty_per_channel_affine_quantized(
            shape, scales=scales, zero_points=zero_points, axis=axis, dtype=dtype)
    _byte_view(tensor.untyped_storage()).copy_(data)
    return tensor


def _placed_item(tensor: torch.Tensor, writer: SlabWriter) -> Any:
    """An economic item's tensor written at its place in its batch's slab, as the contiguous row
    the stacked batch will view there (one copy, whatever its strides: a decoded image is often
    a permuted view); None when the writer gives it no place, after noting its size (see
    ``SlabWriter.carry_items``). Every tensor of an item asks, small ones included: its bytes then
    cross neither the socket nor a second copy into the stack."""
    itemsize = tensor.element_size()
    nbytes = tensor.numel() * itemsize
    if nbytes == 0:
        return None
    room = writer.allocate(nbytes)
    if room is None:
        return None
    slab_storage, offset = room
    shape = tuple(tensor.shape)
    torch.empty((0,), dtype=tensor.dtype).set_(slab_storage, offset // itemsize, shape).copy_(tensor)
    return (_placed_tensor, (writer.slab_id, offset, _DTYPE_INDEX[tensor.dtype], shape))


def _whole_inline_tensor(tensor: torch.Tensor, storage: torch.UntypedStorage) -> Any:
    """(slot, bytes) when the tensor is all of a small storage seen first here, else None.

    The common case for small batches gets one opcode and two torch calls on each side instead of
    a storage and a tensor built separately.
    """
    out = _outgoing
    nbytes = storage.nbytes()
    if (nbytes == 0 or nbytes > INLINE_MAX_BYTES or nbytes > out.inline_left
            or tensor.storage_offset() != 0 or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() != nbytes):
        return None
    if out.writer is not None and out.writer.owns(storage):
        return None
    key = (storage.data_ptr(), nbytes)
    if key in out.slots:
        return None
    slot = out.slots[key] = len(out.slots)
    out.inline_left -= nbytes
    return slot, _raw_bytes(storage)


def _reduce_storage(storage: torch.UntypedStorage) -> Any:
    out = _outgoing
    if storage.device.type != "cpu":
        return _torch_reduce_storage(storage)
    nbytes = storage.nbytes()
    key = (storage.data_ptr(), nbytes)
    slot = out.slots.get(key)
    if slot is not None:
        return (_storage_at, (slot, Placement.CACHED, None))
    slot = out.slots[key] = len(out.slots)
    return (_storage_at, (slot, *_place(storage, nbytes, out)))


def _place(storage: torch.UntypedStorage, nbytes: int, out: _Outgoing) -> tuple[int, Any]:
    writer = out.writer
    if nbytes == 0:
        return Placement.INLINE, bytearray()
    if writer is not None and writer.owns(storage):
        return Placement.SLAB, _slab_ref(out)
    if nbytes <= INLINE_MAX_BYTES and nbytes <= out.inline_left:
        out.inline_left -= nbytes
        return Placement.INLINE, _raw_bytes(storage)
    if storage.is_shared():
        return Placement.DESCRIPTOR, (_pass_descriptor(storage, out), nbytes)
    # An item's tensors asked for their places already (_placed_item); one that got none goes
    # to fresh memory, as the bump allocator's room belongs to the batch worker's outputs.
    room = writer.allocate(nbytes) if writer is not None and not writer.carries_items else None
    if room is not None:
        slab_storage, offset = room
        _copy_bytes(slab_storage, offset, storage, nbytes)
        return Placement.REGION, (_slab_ref(out), offset, nbytes)
    fresh = writer.one_shot(nbytes) if writer is not None else one_shot_storage(nbytes)
    _copy_bytes(fresh, 0, storage, nbytes)
    return Placement.DESCRIPTOR, (_pass_descriptor(fresh, out), nbytes)


def _raw_bytes(storage: torch.UntypedStorage) -> pickle.PickleBuffer:
    """The storage's bytes, pickled in-band (a copy into the message; a bytearray on arrival)."""
    nbytes = storage.nbytes()
    _outgoing.keep_alive.append(storage)  # the raw view below does not hold it
    return pickle.PickleBuffer((ctypes.c_ubyte * nbytes).from_address(storage.data_ptr()))


def _pass_descriptor(storage: torch.UntypedStorage, out: _Outgoing) -> int:
    fd, _ = storage._share_fd_cpu_()
    out.fds.append(fd)
    out.keep_alive.append(storage)
    return len(out.fds) - 1


def _copy_bytes(target: torch.UntypedStorage, offset: int, source: torch.UntypedStorage, nbytes: int) -> None:
    """Copy ``nbytes`` of ``source`` into ``target`` at ``offset``, on this thread alone.

    Not ``Tensor.copy_``: a large copy there runs on torch's OpenMP threads, and a process forked
    from one that has used them (a user's ``multiprocessing.Process`` putting tensors into a
    ``DataLoaderQueue``) hangs in its first parallel region. ``memmove`` releases the GIL too.
    """
    ctypes.memmove(target.data_ptr() + offset, source.data_ptr(), nbytes)


def _byte_view(storage: torch.UntypedStorage, offset: int = 0, nbytes: int | None = None) -> Any:
    view = torch.empty((0,), dtype=torch.uint8)
    size = storage.nbytes() - offset if nbytes is None else nbytes
    return view.set_(storage, offset, (size,), (1,))


# -- decoding (consumer side) ---------------------------------------------------------------


class _Incoming(threading.local):
    """Per-message state of the decoder, for the thread decoding it."""

    pool: Any = None
    producer: int | None = None  # the pool's number for the producer that sent it
    shared_bytes = 0  # what the message says it needed outside it
    fds: list[int] = []
    storages: dict[int, Any] = {}  # slot -> storage, or a tensor that is all of one
    lease: memoryview | None = None
    lease_slab = -1


_incoming = _Incoming()


def decode(payload: bytes | bytearray | memoryview, fds: list[int], pool: Any,
           producer: int | None = None) -> tuple[Any, MessageInfo]:
    """Rebuild a message made by :func:`encode`; closes every received descriptor.

    Args:
        payload: the message bytes.
        fds: the descriptors that came with it.
        pool: the :class:`~pipeload.transport.slab_pool.SlabPool` its slab references belong to
            (None where no slab can have been granted).
        producer: the pool's number for the producer that sent it, which may offer the pool the
            buffer it wrote the message into (None: the pool takes over no such buffer).

    Raises:
        TooManyOpenFilesError: mapping a storage failed because this process is out of file
            descriptors (each storage that arrives by descriptor keeps a duplicate of it).
    """
    wire = _SHORT_WIRES.get(payload[0]) if payload and not fds else None
    if wire is not None:
        report, outcome = wire.decode_report(payload, _DTYPES)
        return report, (NO_INFO if outcome == GrantOutcome.NO_GRANT
                        else MessageInfo(0, GRANT_OUTCOMES[outcome]))
    incoming = _incoming
    incoming.pool, incoming.fds, incoming.storages, incoming.lease = pool, fds, {}, None
    try:
        shared, outcome = _TRAILER.unpack_from(payload, len(payload) - _TRAILER.size)
        incoming.producer, incoming.shared_bytes = producer, shared
        obj = pickle.loads(payload)  # stops at the pickle's end; the trailer follows
        if shared == 0 and outcome == GrantOutcome.NO_GRANT:
            return obj, NO_INFO
        return obj, MessageInfo(shared, GRANT_OUTCOMES[outcome])
    except RuntimeError as exc:
        if descriptor_table_full():  # checked before ours are closed: they count against it
            raise TooManyOpenFilesError(too_many_open_files(DESCRIPTORS_PER_KEPT_BATCH)) from exc
        raise
    finally:
        incoming.pool, incoming.fds, incoming.storages, incoming.lease = None, [], {}, None
        incoming.producer = None
        for fd in fds:
            os.close(fd)


def _storage_at(slot: int, placement: int, detail: Any) -> torch.UntypedStorage:
    incoming = _incoming
    if placement == Placement.CACHED:
        known = incoming.storages[slot]
        return known if isinstance(known, torch.UntypedStorage) else known.untyped_storage()
    if placement == Placement.INLINE:
        if len(detail):
            storage = torch.frombuffer(detail, dtype=torch.uint8).untyped_storage()
            keep_lease_with(storage, detail)  # see _inline_tensor
        else:
            storage = torch.UntypedStorage(0)
    elif placement == Placement.DESCRIPTOR:
        index, nbytes = detail
        note_received(incoming.fds[index])
        try:
            storage = storage_from_descriptor(incoming.fds[index], nbytes)
        except RuntimeError as exc:
            if "Cannot allocate memory" not in str(exc):
                raise
            raise SharedMemoryError(cannot_map_message(nbytes)) from exc
    elif placement == Placement.SLAB:
        storage = torch.frombuffer(_lease(detail), dtype=torch.uint8).untyped_storage()
        keep_lease_with(storage, incoming.lease)
    else:
        slab_id, offset, nbytes = detail
        region = _lease(slab_id)[offset:offset + nbytes]
        storage = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()
        keep_lease_with(storage, incoming.lease)
    incoming.storages[slot] = storage
    return storage


def _lease(slab_id: int) -> memoryview:
    incoming = _incoming
    if incoming.lease is None:
        if slab_id < 0:
            incoming.lease = _offered_lease(slab_id)
        elif incoming.pool is None:
            raise ValueError(f"a message refers to slab {slab_id} but no slab pool receives it")
        else:
            incoming.lease = incoming.pool.open_lease(slab_id)
        incoming.lease_slab = slab_id
    elif incoming.lease_slab != slab_id:
        raise ValueError(f"a message refers to two slabs ({incoming.lease_slab}, {slab_id})")
    return incoming.lease


def _offered_lease(ref: int) -> memoryview:
    """A view of the buffer the producer wrote the message into (``_slab_ref``): taken over by
    the pool as a slab when it has a use for one, else mapped for this message alone."""
    incoming = _incoming
    index = -1 - ref
    if not 0 <= index < len(incoming.fds):
        raise ValueError(f"a message refers to descriptor {index}, which did not come with it")
    fd = incoming.fds[index]
    size = os.fstat(fd).st_size
    pool, producer = incoming.pool, incoming.producer
    if pool is not None and producer is not None:
        adopted = pool.adopt(fd, size, incoming.shared_bytes, producer)
        if adopted is not None:
            return adopted
    note_received(fd)
    # What the message wrote lies within what it says it needed: the slab's headroom beyond
    # that is not mapped for one batch (an address-space limit counts every byte mapped).
    nbytes = min(size, -(-incoming.shared_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    try:
        mapping = mmap.mmap(fd, nbytes)
    except OSError as exc:
        raise SharedMemoryError(cannot_map_message(nbytes)) from exc
    return memoryview(np.frombuffer(mapping, dtype=np.uint8))


def _inline_tensor(slot: int, data: bytearray, dtype_index: int,
                   shape: tuple[int, ...]) -> torch.Tensor:
    tensor = torch.frombuffer(data, dtype=_DTYPES[dtype_index]).view(shape)
    # The message's bytes stay for as long as the storage does, not only while it views them:
    # share_memory_() (a torch.multiprocessing queue's put) moves it and would free them under
    # a numpy array or memoryview taken before (lease_holders.py).
    keep_lease_with(tensor.untyped_storage(), data)
    _incoming.storages[slot] = tensor  # its storage is made only if another tensor shares it
    return tensor


def _placed_tensor(slab_id: int, offset: int, dtype_index: int, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = _DTYPES[dtype_index]
    nbytes = math.prod(shape) * dtype.itemsize
    tensor = torch.frombuffer(_lease(slab_id)[offset:offset + nbytes], dtype=dtype)
    keep_lease_with(tensor.untyped_storage(), _incoming.lease)
    return tensor.view(*shape) if shape else tensor.view(())


def _rebuild_tensor(storage: torch.UntypedStorage, dtype_index: int, size: tuple[int, ...],
                    stride: tuple[int, ...], offset: int) -> torch.Tensor:
    tensor = torch.empty((0,), dtype=_DTYPES[dtype_index])
    return tensor.set_(storage, offset, size, stride)
