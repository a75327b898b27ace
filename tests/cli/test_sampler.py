"""The benchmarks' memory sampler runs in a process of its own (``pipeload.cli.sampler``): it must
read the measured tree without running anything in the measured process, leave itself out of
what it reads, and end with the command."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from pipeload.cli import measure, sampler, tree_memory

CHILD_BYTES = 64 << 20
# A child that touches CHILD_BYTES of its own memory, says so, and holds it until stdin closes.
HOLDING_CHILD = (
    "import sys\n"
    f"data = bytearray({CHILD_BYTES})\n"
    "data[::4096] = b'\\1' * len(data[::4096])\n"
    "print('holding', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_window_reads_a_childs_memory_without_a_thread_in_the_measured_process() -> None:
    threads_before = threading.active_count()
    child = subprocess.Popen([sys.executable, "-c", HOLDING_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        own_rss = psutil.Process().memory_info().rss
        with measure.PeakSampler() as peaks:
            assert child.stdout.readline().strip() == "holding"
            assert threading.active_count() == threads_before  # nothing samples in here
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert peaks.peaks["rss"] >= own_rss + CHILD_BYTES


def test_the_sampler_process_leaves_itself_out_of_the_tree_it_reads() -> None:
    own = sampler.shared_sampler(measure.BASIC_READINGS)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pids = tree_memory.tree_pids_by_proc(os.getpid(), own.pid)
        assert os.getpid() in pids and child.pid in pids
        assert own.pid not in pids
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_commands_written_together_are_each_answered() -> None:
    # A buffered reader took both lines at once and select() then saw nothing: the second
    # command waited forever.
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"start\nstop\n")
        lines = sampler.LineReader(read_end)
        assert lines.next_line(1.0) == "start"
        assert lines.next_line(1.0) == "stop"
        assert lines.next_line(0.05) == ""  # none more: it gives up at the timeout
        os.close(write_end)
        write_end = -1
        assert lines.next_line(1.0) == "" and lines.closed
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_closing_a_sampler_ends_its_process() -> None:
    own = sampler.TreeSampler(measure.BASIC_READINGS)
    process = psutil.Process(own.pid)
    own.start()
    assert own.stop()["rss"] > 0
    own.close()
    assert not own.alive
    assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


def test_ctrl_c_is_left_to_the_measuring_process() -> None:
    # Ctrl-C reaches the whole process group; the sampler printed a KeyboardInterrupt traceback
    # of its own in the middle of `pipeload bench`'s "interrupted".
    own = sampler.TreeSampler(measure.BASIC_READINGS)
    try:
        own.start()
        os.kill(own.pid, signal.SIGINT)
        assert own.stop()["rss"] > 0 and own.alive
    finally:
        own.close()
    assert not own.alive


def _wait_until_asked(conn) -> None:
    conn.recv()


def test_a_worker_forked_while_the_sampler_runs_does_not_keep_it_alive() -> None:
    # The forked worker held the sampler's stdin open: closing it left the sampler waiting
    # (the command's exit took 30 s, and a killed command left it behind).
    own = sampler.shared_sampler(measure.BASIC_READINGS)
    parent_end, child_end = multiprocessing.Pipe()
    worker = multiprocessing.get_context("fork").Process(target=_wait_until_asked, args=(child_end,))
    worker.start()
    try:
        started = time.monotonic()
        sampler.close_shared()
        assert not own.alive and time.monotonic() - started < 3
    finally:
        parent_end.send("go")
        worker.join(timeout=30)


def test_a_window_opened_inside_another_reads_its_own_peaks() -> None:
    # The inner window took over the outer's sampler: the outer never got an answer.
    with measure.PeakSampler() as outer:
        held = bytearray(CHILD_BYTES)
        held[::4096] = b"\1" * len(held[::4096])
        with measure.PeakSampler() as inner:
            pass
        del held
    assert outer.peaks["rss"] > 0 and inner.peaks["rss"] > 0


def test_without_psutil_the_bench_names_the_extra_to_install(tmp_path) -> None:
    (tmp_path / "psutil.py").write_text("raise ModuleNotFoundError(\"No module named 'psutil'\", name='psutil')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "PIPELOAD_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "pipeload", "bench", "--size", "128", "--repeats", "1",
                           "--loaders", "classic"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "pip install 'pipeload[bench]'" in done.stderr and "Traceback" not in done.stderr, done.stderr
