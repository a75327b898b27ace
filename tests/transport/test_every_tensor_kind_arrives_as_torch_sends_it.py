"""Every kind of tensor torch's loader can send arrives through ours as torch delivers it.

A differential test: the same dataset (one kind of tensor per batch, alone or in a list; see
``tensor_kinds.py``) and the same collate function go through ``torch.utils.data.DataLoader``
and through pipeload's, inline and with two process workers (fork and spawn, and economic mode's
item -> batch hop under fork). Each batch is compared with torch's: type (subclasses and their
attributes included), dtype, layout, shape, ``requires_grad`` and leafness, values bit for bit,
and strides and storage offset wherever torch's workers keep them. The flat wire must turn away
what it cannot describe exactly, and the codec (or torch's reductions behind it) carry it.

torch's own workers lose a lazy conjugate or negative bit (the values arrive unconjugated); the
values are therefore compared with what the dataset made, which torch's inline loader hands out
untouched.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.utils.data
from conftest import LeakGuard
from tensor_kinds import FORMS, KINDS, TensorKinds, first_item

import pipeload
from pipeload.transport.codec import _DTYPE_INDEX, INLINE_BUDGET_BYTES, INLINE_MAX_BYTES
from pipeload.transport.flat_wire import encode_report
from pipeload.transport.messages import Report, WorkerReport

OURS = {
    "pipeload-inline": {"num_workers": 0},
    "pipeload-fork": {"num_workers": 2, "multiprocessing_context": "fork"},
    "pipeload-spawn": {"num_workers": 2, "multiprocessing_context": "spawn"},
    "economic-fork": {"num_workers": 2, "multiprocessing_context": "fork", "mode": "economic"},
}
THEIRS = {
    "torch-inline": {"num_workers": 0},
    "torch-fork": {"num_workers": 2, "multiprocessing_context": "fork"},
}
CASES = [(name, form) for name in KINDS for form in FORMS]


def _batches(make_loader: Any, options: dict[str, Any]) -> list[Any]:
    """Every batch of one loader, in order; a batch that failed is its exception (both loaders
    go on after a failed batch), one that never came is None: each test then names its own."""
    loader = make_loader(TensorKinds(), batch_size=1, collate_fn=first_item, **options)
    batches: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse and nested tensors warn on every construction
        iterator = iter(loader)
        while len(batches) < len(TensorKinds()):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
            except Exception as error:  # noqa: BLE001 - the test of that batch reports it
                batches.append(error)
    del iterator
    return batches + [None] * (len(TensorKinds()) - len(batches))


@pytest.fixture(scope="module")
def deliveries() -> Any:
    """Every batch of every loader (torch's and ours), made once for the module; at the end,
    nothing the loaders started or mapped may be left (the leak guard's checks)."""
    guard = LeakGuard()
    got = {name: _batches(torch.utils.data.DataLoader, options) for name, options in THEIRS.items()}
    got.update({name: _batches(pipeload.DataLoader, options) for name, options in OURS.items()})
    yield got
    got.clear()
    problems = guard.leftovers()
    assert not problems, "resource leak:\n  " + "\n  ".join(problems)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a dense tensor as bytes, bit for bit (float8 has no ``equal``; NaN-safe)."""
    plain = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return plain.as_subclass(torch.Tensor).view(torch.uint8)


def _values(tensor: torch.Tensor) -> list[torch.Tensor]:
    """What the tensor holds, as dense byte tensors to compare."""
    if tensor.is_nested:
        return [_bits(part) for part in tensor.unbind()]
    if tensor.is_quantized:
        scales = ((tensor.q_per_channel_scales(), tensor.q_per_channel_zero_points())
                  if tensor.qscheme() is torch.per_channel_affine
                  else (torch.tensor(tensor.q_scale()), torch.tensor(tensor.q_zero_point())))
        return [_bits(tensor.int_repr()), *(_bits(s) for s in scales)]
    if tensor.layout is torch.sparse_coo:
        return [_bits(tensor.to_dense()), _bits(torch.tensor(tensor.is_coalesced()))]
    if tensor.layout is not torch.strided:
        return [_bits(tensor.to_dense())]
    return [_bits(tensor)]


def _shape(tensor: torch.Tensor) -> Any:
    return tuple(tuple(p.shape) for p in tensor.unbind()) if tensor.is_nested else tuple(tensor.shape)


def _layout(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Strides and storage offset of a plain strided tensor (None for other kinds)."""
    if tensor.is_nested or tensor.layout is not torch.strided:
        return None
    return tensor.stride(), tensor.storage_offset()


def _differences(got: torch.Tensor, truth: torch.Tensor, torch_sent: torch.Tensor) -> list[str]:
    """How ``got`` differs from what it should be: ``truth`` (what the dataset made) for values
    and properties, ``torch_sent`` (torch's workers' delivery) for what a process boundary keeps."""
    found = []
    for what, read in (("type", type), ("dtype", lambda t: t.dtype), ("layout", lambda t: t.layout),
                       ("shape", _shape), ("requires_grad", lambda t: t.requires_grad),
                       ("is_leaf", lambda t: t.is_leaf), ("tag", lambda t: getattr(t, "tag", None))):
        if read(got) != read(truth):
            found.append(f"{what}: {read(got)!r}, expected {read(truth)!r}")
    if not found:
        mine, theirs = _values(got), _values(truth)
        if len(mine) != len(theirs) or not all(torch.equal(a, b) for a, b in zip(mine, theirs)):
            found.append("values differ")
    if _torch_kept(torch_sent, truth) and _layout(got) != _layout(truth):
        found.append(f"strides and offset {_layout(got)}, torch keeps {_layout(truth)}")
    return found


def _torch_kept(torch_sent: torch.Tensor, truth: torch.Tensor) -> bool:
    """Whether torch's workers delivered the tensor's strides and offset, and its values with
    them (a quantized tensor arrives from them without its quantizer, which cannot be read)."""
    try:
        values = _values(torch_sent)
    except RuntimeError:
        return False
    return (_layout(torch_sent) == _layout(truth)
            and all(torch.equal(a, b) for a, b in zip(values, _values(truth))))


def _leaves(batch: Any) -> list[Any]:
    return list(batch) if isinstance(batch, list) else [batch]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "form"), CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_each_tensor_kind_arrives_as_torch_delivers_it(deliveries, kind, form):
    index = TensorKinds.index_of(kind, form)
    truth, torch_sent = deliveries["torch-inline"][index], deliveries["torch-fork"][index]
    problems = []
    for loader in OURS:
        got = deliveries[loader][index]
        if got is None or isinstance(got, Exception):
            problems.append(f"{loader}: no batch: {got!r}")
            continue
        if type(got) is not type(truth) or len(_leaves(got)) != len(_leaves(truth)):
            problems.append(f"{loader}: batch of type {type(got).__name__}, expected {type(truth).__name__}")
            continue
        for got_leaf, true_leaf, torch_leaf in zip(_leaves(got), _leaves(truth), _leaves(torch_sent)):
            problems += [f"{loader}: {p}" for p in _differences(got_leaf, true_leaf, torch_leaf)]
    assert not problems, "\n".join(problems)


class _KeepsWhatItReturns(TensorKinds):
    """``TensorKinds``, holding on to every item it returned, in order."""

    def __init__(self) -> None:
        self.returned: list[Any] = []

    def __getitem__(self, index: int) -> Any:
        item = super().__getitem__(index)
        self.returned.append(item)
        return item


def test_inline_loaders_hand_out_the_dataset_s_own_objects(deliveries):
    # Without workers, nothing is sent: ours, like torch's, hands out what collate returned,
    # which here is the very object the dataset returned (a tensor, or a list holding one).
    for index, (mine, theirs) in enumerate(zip(deliveries["pipeload-inline"], deliveries["torch-inline"])):
        for got, truth in zip(_leaves(mine), _leaves(theirs)):
            assert _layout(got) == _layout(truth) and got.is_conj() == truth.is_conj(), index
    for make_loader in (pipeload.DataLoader, torch.utils.data.DataLoader):
        dataset = _KeepsWhatItReturns()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse and nested tensors warn on every construction
            handed_out = list(make_loader(dataset, batch_size=1, collate_fn=first_item))
        assert len(handed_out) == len(dataset.returned) == len(dataset)
        for index, (got, made) in enumerate(zip(handed_out, dataset.returned)):
            assert got is made, (make_loader.__module__, index)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in
                                  ("strided", "large", "zero-size", "zero-size-inner", "scalar",
                                   "bool", "bfloat16", "complex") and "float8" not in k])
def test_the_flat_wire_turns_away_every_tensor_it_cannot_describe_exactly(kind):
    tensor = KINDS[kind](torch.Generator().manual_seed(0))
    for batch in (tensor, [tensor, torch.ones(2)]):
        report = WorkerReport(Report.BATCH, 0, 0, batch, None, 0.0, 0.0, 0.0)
        assert encode_report(report, None, _DTYPE_INDEX, INLINE_MAX_BYTES, INLINE_BUDGET_BYTES) is None


@pytest.mark.parametrize("kind", ["strided", "zero-size", "zero-size-inner", "scalar", "bool",
                                  "bfloat16", "complex", *(k for k in KINDS if "float8" in k)])
def test_the_flat_wire_still_takes_plain_dense_tensors(kind):
    tensor = KINDS[kind](torch.Generator().manual_seed(0))
    report = WorkerReport(Report.BATCH, 0, 0, [tensor, torch.ones(2)], None, 0.0, 0.0, 0.0)
    assert encode_report(report, None, _DTYPE_INDEX, INLINE_MAX_BYTES, INLINE_BUDGET_BYTES) is not None
