"""The doorbell that wakes a sleeping compiled-graph read (actors.channel_wait), between two
plain processes: no Ray needed to see a ring wake a reader, a gone reader dropped, stale
doorbells removed. The same reads inside a Ray compiled graph: tests/test_ray_graph.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from actors import channel_wait


@pytest.fixture(autouse=True)
def bell_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(channel_wait, "BELL_DIR", str(tmp_path / "bells"))
    return tmp_path / "bells"


def _reader(bell_dir: str, ref_hex: str, ready, done) -> None:
    channel_wait.BELL_DIR = bell_dir
    bell = channel_wait._Bell(ref_hex)
    ready.set()
    start = time.monotonic()
    bell.wait(30.0)
    done.put((time.monotonic() - start, bell.rung))


def test_a_ring_wakes_a_reader_in_another_process(bell_dir):
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_reader, args=(str(bell_dir), "ab12", ready, done))
    child.start()
    try:
        assert ready.wait(30)
        ringer = channel_wait._Ringer("ab12")
        time.sleep(0.2)  # the reader is asleep in its wait
        ringer.ring()
        waited, rung = done.get(timeout=30)
        assert rung
        assert waited < 10.0  # woken by the ring, not at the end of its 30 s wait
    finally:
        child.join(10)


def test_a_bell_without_a_ring_times_out_unrung():
    bell = channel_wait._Bell("cd34")
    bell.wait(0.01)
    assert not bell.rung
    channel_wait._Ringer("cd34").ring()
    bell.wait(0.01)
    assert bell.rung


def test_ringing_with_no_reader_or_a_gone_one_is_harmless(bell_dir):
    channel_wait._Ringer("ef56").ring()  # nobody listens: nothing to do, no directory yet
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_reader, args=(str(bell_dir), "ef56", ready, done))
    child.start()
    assert ready.wait(30)
    ringer = channel_wait._Ringer("ef56")
    ringer.ring()
    done.get(timeout=30)
    child.join(10)
    for _ in range(3):  # the reader exited: its pipe breaks, and the ringer lets it go
        ringer.ring()
    assert ringer.fds == []


def test_stale_doorbells_of_exited_processes_are_removed(bell_dir):
    os.makedirs(bell_dir, exist_ok=True)
    ctx = mp.get_context("fork")
    gone = ctx.Process(target=lambda: None)
    gone.start()
    gone.join()
    stale, live = bell_dir / f"aa.{gone.pid}", bell_dir / f"bb.{os.getpid()}"
    os.mkfifo(stale)
    os.mkfifo(live)
    channel_wait.remove_stale_bells()
    assert not stale.exists() and live.exists()
