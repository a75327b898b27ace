"""How batches made in process workers reach the main process.

Small batches travel inside the message; large ones in reusable shared-memory slabs (or fresh
buffers when no slab is free), viewed in place. Kept batches and kept views are never
overwritten; custom collate outputs arrive whole; a /dev/shm smaller than a batch does not stop
loading; thread workers hand tensors over as they are; pin_memory without an accelerator warns.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data
from conftest import backing_of, in_shared_memory
from faults import (
    ECONOMIC,
    ECONOMIC_SPAWN,
    ECONOMIC_THREAD,
    FORK,
    SPAWN,
    THREAD,
    MakesTensors,
    MakesTensorsThenDies,
    engine_params,
    loader_kwargs,
    mixed_layout_collate,
    pins_itself_collate,
)

from pipeload import DataLoader
from pipeload.collate import default_collate
from pipeload.errors import WorkerDiedError
from pipeload.pin import pinning_available

pytestmark = [pytest.mark.usefixtures("leak_guard"), pytest.mark.timeout(60)]

BIG = 1 << 16  # floats per item: 256 KiB, far above what travels inside a message


def expected_rows(batch_number: int, batch_size: int) -> list[float]:
    return [float(batch_number * batch_size + k) for k in range(batch_size)]


@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN, ECONOMIC, ECONOMIC_SPAWN, slow=(SPAWN, ECONOMIC_SPAWN)))
@pytest.mark.timeout(90)
def test_small_batches_travel_inside_the_message(engine):
    loader = DataLoader(MakesTensors(8), batch_size=4, num_workers=2, **loader_kwargs(engine))
    batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not any(in_shared_memory(b) for b in batches)


# spawn: slow tests (~1.5 s each); spawned workers' slabs run fast in tests/engine/test_slabs_outlive_workers.py
@pytest.mark.parametrize("engine", engine_params(FORK, SPAWN, ECONOMIC, slow=(SPAWN,)))
@pytest.mark.timeout(90)
def test_large_batches_arrive_in_reused_slabs(engine):
    loader = DataLoader(MakesTensors(96, BIG), batch_size=4, num_workers=2, **loader_kwargs(engine))
    addresses = []
    for number, batch in enumerate(loader):  # each batch is dropped before the next arrives
        assert batch[:, 0].tolist() == expected_rows(number, 4)
        assert batch[:, -1].tolist() == expected_rows(number, 4)
        # economic mode's first batch: collated by the main process, from its samples (nothing
        # was known of the items when it went out)
        assert in_shared_memory(batch) or (engine.economic and number == 0)
        addresses.append(batch.data_ptr())
    # The first batches travel in fresh buffers (their size is not known yet); then a handful of
    # slabs (at most the 4 batches in flight + 2 at a time) serve the others. On a loaded machine
    # a batch whose slab was not released in time takes a one-shot buffer, and a budget that
    # moves may retire a surplus slab and later make another; so count the addresses that served
    # several batches, and how many batches they served (undisturbed: 5 slabs, 4 batches each).
    later = addresses[4:]
    reused = {address for address in later if later.count(address) >= 2}
    assert len(reused) <= 8, addresses
    assert sum(address in reused for address in later) >= 0.75 * len(later), addresses


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_kept_batches_are_never_overwritten(engine):
    loader = DataLoader(MakesTensors(160, BIG), batch_size=4, num_workers=2, **loader_kwargs(engine))
    batches = list(loader)  # the pool grows to its bound, then fresh memory takes over
    for number, batch in enumerate(batches):
        assert torch.equal(batch, torch.tensor(expected_rows(number, 4))[:, None].expand(4, BIG))


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_a_kept_view_keeps_its_slab_out_of_the_pool(engine):
    loader = DataLoader(MakesTensors(120, BIG), batch_size=4, num_workers=2, **loader_kwargs(engine))
    kept = None
    for number, batch in enumerate(loader):
        if number == 3:
            kept = batch[1:3, 100:200]  # a view: the batch itself is dropped
    assert kept is not None
    assert torch.equal(kept, torch.tensor([13.0, 14.0])[:, None].expand(2, 100))


class KeepsItsLastOutput:
    """A collate function that sends its previous output again beside each batch (and the sample
    values it held, as plain numbers): the worker keeps a view of a slab it wrote."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.last_values: list[float] | None = None

    def __call__(self, samples):
        batch = default_collate(samples)
        out = (batch, self.last if self.last is not None else torch.zeros_like(batch), self.last_values)
        self.last, self.last_values = batch, [float(sample[0]) for sample in samples]
        return out


@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_a_workers_kept_output_is_never_written_over_by_another_worker(engine, persistent):
    # The slab the worker still viewed went to the other worker once the loop let go of the
    # batch, and the kept tensor came back with the other worker's values: 1 batch in 108
    # wrong in classic mode, 15 in economic mode.
    loader = DataLoader(MakesTensors(96, BIG), batch_size=8, num_workers=2, persistent_workers=persistent,
                        collate_fn=KeepsItsLastOutput(), **loader_kwargs(engine))
    compared = 0
    for _ in range(3):
        for _batch, last, last_values in loader:
            if last_values is not None:
                assert last[:, 0].tolist() == last_values
                compared += 1
    assert compared >= 3 * 96 // 8 - 2 * 3
    # The kept tensor travels as its own bytes, not as the whole slab it views: slabs grew by a
    # slab a batch (each sized for the last one's, sent again), 134 made for 200 batches. And
    # the slab a worker holds back does not take the place of one for the batches in flight.
    counts = loader._slab_keeper.counts()
    assert counts.slabs_made <= 12 and counts.batches_in_slabs >= 30, counts


class KeepsEveryOutput:
    """A collate function that keeps every output it made (a worker-side replay memory) and
    checks, after collating each batch where it travels, that none of them has changed."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, list[float]]] = []

    def __call__(self, samples):
        batch = default_collate(samples)
        for old, values in self.kept:
            if old[:, 0].tolist() != values:
                raise AssertionError(f"kept output written over: {old[:, 0].tolist()}, collated as {values}")
        self.kept.append((batch, [float(sample[0]) for sample in samples]))
        return batch


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_kept_output_of_a_new_loaders_first_batches_is_never_written_over(num_workers):
    # A new loader's first batches travel in buffers their workers make, which the pool takes
    # over as slabs. A buffer the worker's collate function still views must be granted to no
    # one, nor written by its own worker through a second mapping of it. (The byte budget keeps
    # the pool to a few slabs, so that each is granted again.)
    for _ in range(2):
        loader = DataLoader(MakesTensors(48, BIG), batch_size=4, num_workers=num_workers,
                            max_shm_bytes=4 << 20, collate_fn=KeepsEveryOutput(),
                            multiprocessing_context="fork")
        for number, batch in enumerate(loader):
            assert batch[:, 0].tolist() == expected_rows(number, 4)
        counts = loader._slab_keeper.counts()
        assert counts.slabs_adopted > 0 and counts.busy > 0, counts  # taken over, then refused
        del loader


@pytest.mark.parametrize("engine, width", [pytest.param(FORK, 16, id="inline"),
                                           pytest.param(ECONOMIC, 1 << 14, id="economic-first-batches")])
def test_a_numpy_view_keeps_its_values_when_the_batch_moves_to_shared_memory(engine, width):
    # share_memory_() (a torch.multiprocessing queue's put) moved batches that were not in shared
    # memory (small ones, inline; the first of economic mode, collated here) and freed their
    # bytes under a numpy array taken before: it read freed memory. torch's worker batches are in
    # shared memory already, so the call changes nothing there.
    loader = DataLoader(MakesTensors(40, width), batch_size=4, num_workers=2, **loader_kwargs(engine))
    kept = []
    for batch in loader:
        array = batch.numpy()
        batch.share_memory_()
        kept.append(array)
        del batch
    scratch = [torch.randn(4, width) for _ in range(40)]  # reuses what was freed, if anything was
    assert [array[:, 0].tolist() for array in kept] == [expected_rows(number, 4) for number in range(10)]
    del scratch


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_uncollated_tensors_large_in_shared_memory_small_inline(engine):
    big = list(DataLoader(MakesTensors(4, BIG), batch_size=None, num_workers=2,
                          **loader_kwargs(engine)))
    small = list(DataLoader(MakesTensors(4), batch_size=None, num_workers=2,
                            **loader_kwargs(engine)))
    assert [t[0].item() for t in big] == [0, 1, 2, 3] == [t[0].item() for t in small]
    assert all(in_shared_memory(t) for t in big)
    assert not any(in_shared_memory(t) for t in small)


@pytest.mark.parametrize("width", [16, BIG], ids=["small", "large"])
def test_custom_collate_outputs_and_views_arrive_whole(width):
    dataset = MakesTensors(16, width)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=mixed_layout_collate,
                        multiprocessing_context="fork")
    for number, got in enumerate(loader):
        want = mixed_layout_collate([dataset[i] for i in range(number * 4, number * 4 + 4)])
        assert got.keys() == want.keys()
        for key in ("transposed", "first_half", "every_other_row"):
            assert torch.equal(got[key], want[key]) and got[key].stride() == want[key].stride()
        assert np.array_equal(got["numpy"], want["numpy"])
        assert (got["name"], got["count"]) == (want["name"], want["count"])
        # Two views of one storage arrive as views of one storage.
        assert got["first_half"].untyped_storage().data_ptr() == \
            got["transposed"].untyped_storage().data_ptr()


@pytest.mark.parametrize("engine", engine_params(FORK, ECONOMIC))
def test_persistent_workers_keep_their_slabs_across_epochs_and_abandoned_ones(engine):
    loader = DataLoader(MakesTensors(64, BIG), batch_size=4, num_workers=2,
                        persistent_workers=True, **loader_kwargs(engine))
    for abandon_after in (2, 5, None, 1, None):
        for number, batch in enumerate(loader):
            assert batch[:, 0].tolist() == expected_rows(number, 4)
            if number == abandon_after:
                break
    del loader


def test_out_of_order_batches_from_slabs():
    loader = DataLoader(MakesTensors(64, BIG), batch_size=4, num_workers=2, in_order=False,
                        multiprocessing_context="fork")
    firsts = sorted(int(batch[0, 0].item()) for batch in loader)
    assert firsts == list(range(0, 64, 4))


@pytest.mark.parametrize("engine", engine_params(THREAD, ECONOMIC_THREAD))
def test_thread_workers_hand_over_tensors_as_they_are(engine):
    loader = DataLoader(MakesTensors(8, BIG), batch_size=4, num_workers=2, **loader_kwargs(engine))
    batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not any(in_shared_memory(b) for b in batches)


def test_a_byte_budget_of_one_batch_still_loads_everything_in_the_loops_two_slabs():
    # One batch in flight, in the two slabs a loop needs (the batch it holds and the next): a
    # pool of one slab, held by the loop, sent every other batch to fresh memory, uncounted,
    # and the budget took more memory than none (stop 54's transport skeptic).
    batch_bytes = 4 * BIG * 4
    loader = DataLoader(MakesTensors(48, BIG), batch_size=4, num_workers=2,
                        max_shm_bytes=batch_bytes, multiprocessing_context="fork")
    iterator = iter(loader)
    for number, batch in enumerate(iterator):
        assert batch[:, 0].tolist() == expected_rows(number, 4)
        assert iterator._engine._workers.slabs.slab_count <= 2
        assert iterator._engine._ledger.outstanding <= 1
    counts = loader._slab_keeper.counts()
    assert counts.batches_in_slabs >= counts.batches_in_shared_memory - 2  # the first ones size them


def test_a_worker_killed_while_slabs_are_in_use_is_reported_and_leaves_nothing():
    loader = DataLoader(MakesTensorsThenDies(64, BIG, bad_index=37, how="sigkill"), batch_size=4,
                        num_workers=2, multiprocessing_context="fork")
    seen = []
    with pytest.raises(WorkerDiedError, match="signal 9"):
        for batch in loader:
            seen.append(int(batch[0, 0].item()))
    # Batches before the dead worker's arrive intact (the death may be seen before the last few).
    assert seen == list(range(0, 4 * len(seen), 4)) and len(seen) <= 9


def test_collated_output_matches_the_main_process_collate():
    dataset = MakesTensors(8, BIG)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    for number, batch in enumerate(loader):
        want = default_collate([dataset[i] for i in range(number * 4, number * 4 + 4)])
        assert torch.equal(batch, want) and batch.stride() == want.stride()
        assert batch.dtype == want.dtype and batch.shape == want.shape


# -- pin_memory ------------------------------------------------------------------------------


@pytest.mark.skipif(pinning_available(), reason="an accelerator is present: batches are really pinned")
@pytest.mark.parametrize("engine", engine_params(FORK, THREAD, ECONOMIC) + [pytest.param(None, id="inline")])
def test_pin_memory_without_accelerator_warns_once_and_passes_batches_through(engine):
    workers = {} if engine is None else {"num_workers": 2, **loader_kwargs(engine)}
    plain = [b.tolist() for b in DataLoader(MakesTensors(6), batch_size=4, **workers)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user sees: each warning once per place
        loader = DataLoader(MakesTensors(6), batch_size=4, pin_memory=True, **workers)
        epochs = [list(loader) for _ in range(3)]
    pin_warnings = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pin_warnings) == 1, [str(w.message) for w in caught]
    assert "no accelerator" in str(pin_warnings[0].message)
    for batches in epochs:
        assert [b.tolist() for b in batches] == plain
        assert not any(b.is_pinned() for b in batches)


@pytest.mark.skipif(pinning_available(), reason="an accelerator is present: batches are really pinned")
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_pin_memory_without_accelerator_still_loads_large_batches_through_plain_slabs():
    # The slab path with pin_memory=True on a CPU-only machine: slabs are made and reused as
    # without it (nothing to page-lock them for), and batches stay unpinned, as torch's do.
    loader = DataLoader(MakesTensors(48, BIG), batch_size=4, num_workers=2, pin_memory=True,
                        multiprocessing_context="fork")
    in_slabs = 0
    for number, batch in enumerate(loader):
        assert not batch.is_pinned()
        assert batch[:, 0].tolist() == expected_rows(number, 4)
        in_slabs += backing_of(batch).startswith("/memfd:")
    assert in_slabs >= 6  # after the first few (fresh buffers until a batch's size is known)


@pytest.mark.skipif(pinning_available(), reason="an accelerator is present: batches are really pinned")
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
@pytest.mark.parametrize("module", ["torch", "pipeload"])
def test_pin_memory_without_accelerator_never_asks_custom_batches_to_pin(module):
    # torch builds no pin thread without an accelerator, so a batch's own pin_memory() (which
    # would raise here) is never called; neither is ours.
    loader_class = torch.utils.data.DataLoader if module == "torch" else DataLoader
    loader = loader_class(MakesTensors(8, BIG), batch_size=4, num_workers=2, pin_memory=True,
                          collate_fn=pins_itself_collate, multiprocessing_context="fork")
    batches = list(loader)
    assert [batch.pinned_by_itself for batch in batches] == [False, False]
    assert batches[1].data[:, 0].tolist() == expected_rows(1, 4)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to pin slabs")


@needs_cuda
def test_pinned_loader_hands_out_slab_batches_pinned_without_a_copy():
    loader = DataLoader(MakesTensors(96, BIG), batch_size=4, num_workers=2, pin_memory=True,
                        multiprocessing_context="fork")
    for epoch in range(2):  # the second epoch's workers reuse the slabs, page-locked once
        in_slabs = 0
        before = loader._slab_keeper.counts()
        for number, batch in enumerate(loader):
            assert batch.is_pinned()
            assert batch[:, 0].tolist() == expected_rows(number, 4)
            in_slabs += backing_of(batch).startswith("/memfd:")  # the slab itself, not a copy
            gpu = batch.cuda(non_blocking=True)
            assert torch.equal(gpu[:, -1].cpu(), torch.tensor(expected_rows(number, 4)))
        del batch, gpu
        counts = loader._slab_keeper.counts()
        # Every batch written into a slab reached the loop in it, pinned, with no copy. How many
        # were (rather than in one-shot buffers: the first ones, while a batch's size is
        # unknown; one whose slab a slow release kept) depends on timing; most are.
        assert in_slabs == counts.batches_in_slabs - before.batches_in_slabs >= 12
    assert counts.slabs_made <= 6  # made (and page-locked) in the first epoch, then reused
    del loader  # the slabs go with the loader: the leak guard checks their descriptors


@needs_cuda
def test_custom_batch_types_still_pin_themselves():
    loader = DataLoader(MakesTensors(16, BIG), batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=pins_itself_collate, multiprocessing_context="fork")
    for number, batch in enumerate(loader):
        assert batch.pinned_by_itself and batch.data.is_pinned()
        assert batch.data[:, 0].tolist() == expected_rows(number, 4)


# -- /dev/shm smaller than a batch -----------------------------------------------------------

# Runs in a private mount namespace whose /dev/shm is a small tmpfs; prints what happened.
_SMALL_SHM_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings, torch
    from pipeload import DataLoader

    class Big:
        def __init__(self, floats): self.floats = floats
        def __len__(self): return 8
        def __getitem__(self, index): return torch.full((self.floats,), float(index))

    def main():
        floats, batch_size = int(sys.argv[2]), sys.argv[3]
        batch_size = None if batch_size == "none" else int(batch_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            loader = DataLoader(Big(floats), batch_size=batch_size, num_workers=2,
                                multiprocessing_context=sys.argv[1])
            firsts = [float(b.reshape(-1, floats)[:, 0].sum()) for b in loader]
            del loader
        print(json.dumps({"firsts": firsts, "warnings": [str(w.message) for w in caught],
                          "left_in_shm": sorted(os.listdir("/dev/shm"))}))

    if __name__ == "__main__":  # spawn's workers import this script again
        main()
    """
)


def _small_shm_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True, timeout=30,
    )
    return probe.returncode == 0


def _run_with_small_dev_shm(tmp_path, size: str, args: list[str], env: dict | None = None):
    if not _small_shm_available():
        pytest.skip("needs root to mount a small tmpfs on /dev/shm in a private mount namespace")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM_SCRIPT)
    command = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
               f"exec {sys.executable} {script} {' '.join(args)}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True,
                          text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_64_mib_batches_load_on_a_64_mib_dev_shm_with_one_warning(tmp_path, context):
    # 4 items of 16 MiB: every batch is as large as all of /dev/shm.
    result = _run_with_small_dev_shm(tmp_path, "64m", [context, str(4 << 20), "4"])
    assert result["firsts"] == [0.0 + 1 + 2 + 3, 4.0 + 5 + 6 + 7]
    shm_warnings = [w for w in result["warnings"] if "/dev/shm" in w]
    assert len(shm_warnings) == 1, result["warnings"]
    assert "memfd" in shm_warnings[0] and "torch.utils.data would fail" in shm_warnings[0]
    assert result["left_in_shm"] == []


@pytest.mark.timeout(180)
def test_without_memfd_a_full_dev_shm_falls_back_to_a_file_with_one_warning(tmp_path):
    # 2 MiB items, uncollated, on a 1 MiB /dev/shm, with memfd ruled out: /dev/shm is tried, is
    # found full, and an unlinked file in the temporary directory takes over.
    env = {**__import__("os").environ, "PIPELOAD_SHM_BACKING": "dev-shm", "TMPDIR": str(tmp_path)}
    result = _run_with_small_dev_shm(tmp_path, "1m", ["fork", str(1 << 19), "none"], env)
    assert result["firsts"] == [float(i) for i in range(8)]
    fallback = [w for w in result["warnings"] if "could not make shared memory in /dev/shm" in w]
    assert len(fallback) == 1, result["warnings"]
    assert str(tmp_path) in fallback[0]
    assert result["left_in_shm"] == []
    assert [p.name for p in tmp_path.iterdir()] == ["small_shm.py"]  # nothing left there either


# A custom collate_fn built on torch's own default_collate: in a worker, torch makes the stacked
# batch in its own shared memory (a /dev/shm file), which travels to us as a descriptor.
_TORCH_COLLATE_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch, torch.utils.data
    from pipeload import DataLoader

    class Big:
        def __len__(self): return 8
        def __getitem__(self, index): return torch.full((1 << 16,), float(index))

    def collate_with_torchs(samples):
        return torch.utils.data.default_collate(samples)

    if __name__ == "__main__":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(Big(), batch_size=4, num_workers=2, multiprocessing_context="fork",
                                collate_fn=collate_with_torchs)
            firsts = [b[:, 0].tolist() for b in loader]
        print(json.dumps({"firsts": firsts, "warnings": [str(w.message) for w in caught]}))
    """
)


def test_torchs_own_shared_memory_in_a_batch_is_not_taken_for_ours_running_short(tmp_path):
    # The warning that our memfd could not be made (and batches fell back to /dev/shm) is for
    # buffers we made; torch's, which user code made, say nothing about ours. It told users to
    # give the container more shared memory when nothing was short.
    script = tmp_path / "torch_collate.py"
    script.write_text(_TORCH_COLLATE_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["firsts"] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert not [w for w in result["warnings"] if "could not make shared memory" in w], result["warnings"]
