"""Our compiled-graph channel (actors.shm_channel) between two processes, without Ray running:
values cross whole and in order, the writer waits for the reader, large values move the channel
to a larger segment, a close wakes a waiting reader, and nothing is left in /dev/shm."""

import multiprocessing as mp
import os
import pickle
import threading
import time

import pytest
import torch
from ray.exceptions import RayChannelError, RayChannelTimeoutError

from actors import shm_channel
from actors.shm_channel import ShmChannel
from spec.batch import DraftInput

# Forked children run only the channel (no torch parallel region, no Ray call): seconds faster than spawned ones.
_CTX = mp.get_context("fork")


def _echo(inbound: ShmChannel, outbound: ShmChannel, n: int) -> None:
    """The other process: reads `n` values and writes each back."""
    for _ in range(n):
        outbound.write(inbound.read(timeout=30))


def _read_until_closed(channel: ShmChannel, result) -> None:
    try:
        channel.read(timeout=30)
        result.put("read a value")
    except RayChannelTimeoutError:
        result.put("timed out")
    except RayChannelError:
        result.put("closed")


def _files(channel: ShmChannel) -> list[str]:
    directory, name = os.path.split(channel.name)
    return [n for n in os.listdir(directory) if n.startswith(name)]


def test_values_cross_whole_and_in_order_and_grow_the_segment():
    inbound, outbound = ShmChannel(), ShmChannel()
    big = torch.arange(3 * shm_channel.INITIAL_BYTES // 4, dtype=torch.float32)  # 3x the first area
    batch = DraftInput(verified_id=torch.tensor([5, 7]), hidden_states=torch.randn(2, 3),
                       topk_p=torch.rand(2, 4), topk_index=torch.randint(0, 9, (2, 4)))
    values = [1, "two", big, {"x": b"\0" * 10}, batch, None, big[:5]]
    child = _CTX.Process(target=_echo, args=(pickle.loads(pickle.dumps(inbound)), outbound, len(values)))
    child.start()
    try:
        got = []
        for value in values:  # one at a time: a value is written only after the last was taken
            inbound.write(value, timeout=30)
            got.append(outbound.read(timeout=30))
        child.join(30)
        assert child.exitcode == 0
        assert got[:2] == [1, "two"] and got[3] == {"x": b"\0" * 10} and got[5] is None
        assert torch.equal(got[2], big) and torch.equal(got[6], big[:5])
        assert isinstance(got[4], DraftInput)
        for name in ("verified_id", "hidden_states", "topk_p", "topk_index"):
            assert torch.equal(getattr(got[4], name), getattr(batch, name))
        assert _generation(outbound) >= 1  # the echo's big value moved its channel on
    finally:
        child.kill()
        for channel in (inbound, outbound):
            channel.close()
            assert _files(channel) == []


def _generation(channel: ShmChannel) -> int:
    return shm_channel._HEADER.unpack_from(channel._header(), 0)[4]


def test_the_writer_waits_until_the_reader_took_the_last_value():
    channel = ShmChannel()
    try:
        channel.write("first")
        with pytest.raises(RayChannelTimeoutError):
            channel.write("second", timeout=0.05)  # nobody read "first": it is not overwritten
        reader = ShmChannel(channel.name)
        assert reader.read(timeout=1) == "first"
        channel.write("second", timeout=1)
        assert reader.read(timeout=1) == "second"
        with pytest.raises(RayChannelTimeoutError):
            reader.read(timeout=0.05)
    finally:
        channel.close()


def test_a_close_wakes_a_reader_in_another_process_and_fails_later_writes():
    channel = ShmChannel()
    result = _CTX.Queue()
    child = _CTX.Process(target=_read_until_closed, args=(channel, result))
    child.start()
    try:
        time.sleep(0.5)  # the child maps the segment and waits on its doorbell
        start = time.monotonic()
        channel.close()
        assert result.get(timeout=20) == "closed"
        assert time.monotonic() - start < 5.0  # woken by the close, not by its 30 s timeout
        with pytest.raises(RayChannelError):
            channel.write("late")
        assert _files(channel) == []
    finally:
        child.join(10)
        child.kill()


def test_a_close_in_the_readers_own_process_ends_its_wait():
    """Ray tears a graph down from another thread of the process that may be reading."""
    writer = ShmChannel()
    reader = ShmChannel(writer.name)
    outcome = []

    def read():
        try:
            reader.read(timeout=30)
        except RayChannelError as exc:
            outcome.append(type(exc))

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(0.2)
    reader.close()
    thread.join(5)
    assert outcome == [RayChannelError]
    writer.close()


def test_segments_of_a_dead_writer_are_removed():
    child = _CTX.Process(target=ShmChannel)  # builds a segment, exits without closing it
    child.start()
    child.join(30)
    directory = shm_channel.segment_dir()
    stale = [n for n in os.listdir(directory) if n.startswith(f"{shm_channel._PREFIX}{child.pid}-")]
    assert stale
    ShmChannel().close()  # building a channel sweeps them
    assert not [n for n in stale if os.path.exists(os.path.join(directory, n))]


def test_segments_go_to_the_temp_dir_where_dev_shm_is_small(monkeypatch, tmp_path):
    """A container's 64 MB /dev/shm would fill; a mapped page tmpfs cannot back is a SIGBUS."""
    monkeypatch.setattr(shm_channel, "MIN_SHM_FREE_BYTES", 1 << 62)
    monkeypatch.setattr(shm_channel.tempfile, "tempdir", str(tmp_path))
    channel = ShmChannel()
    try:
        assert os.path.dirname(channel.name) == str(tmp_path)
        reader = ShmChannel(channel.name)
        channel.write(torch.ones(3 * shm_channel.INITIAL_BYTES // 4))  # grows, in the temp dir too
        assert torch.equal(reader.read(timeout=1), torch.ones(3 * shm_channel.INITIAL_BYTES // 4))
    finally:
        channel.close()
    assert _files(channel) == []
