"""A compiled-graph channel of our own: one shared-memory slot between two processes of a node,
the value pickled once, the reader woken by the writer's doorbell.

Ray 2.60's shared-memory channel put most of the actor graph's per-step coordination in its writes
and reads (its serialization context and the core worker's object header protocol; docs/benchmarks.md
session 40: send 0.3-0.5, deliver 0.45-0.6, write 0.55-0.7, receive 0.5-0.7 ms a step). Over this one,
a compiled graph's round trip of 4 KB with nothing to compute takes 1.2-1.3 ms against 1.6-1.7, and
the colocated engine's coordination 2.0-2.9 ms a step against 3.0-3.8 (session 45).
This channel keeps Ray's compiled graph (its schedule, executor loop, teardown and
error values) and replaces only what carries a value: `ShmChannelType` is a type hint that Ray's
compiler asks to build the channel of an edge, and it builds this one where the edge has a single
reader in another process on the writer's node (the step's input to the first actor of a rank, its
result back to the scheduler, the hops between a separate draft actor and the target); any other
edge (a reader on another node, several readers, the writer reading its own output) gets Ray's.

Layout: a control segment (a file under /dev/shm, or the temp dir where /dev/shm is small; mapped
by both sides) whose header

    written (u64), read (u64), closed (u64), length (u64), generation (u64)

is followed by the first payload area; a value larger than that area goes to a payload file of its
own (`<name>.<generation>`, twice the size or more), which the reader maps when it sees the
generation change. The header never moves.

One slot, as Ray's single-buffer channel: the writer waits until the reader took the previous
value (`read == written`), copies the pickle in, then publishes it by raising `written` (x86 keeps
stores in order, so a reader that sees the new count sees the bytes; Python has no fence to ask for
it, so other CPUs keep Ray's channel); the reader copies the bytes out, raises `read`, then
unpickles. The reader sleeps on a doorbell (actors.channel_wait's named pipe) between looks; the
writer rings it after publishing and after closing.
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import struct
import tempfile
import threading
import time
import uuid

import ray
from ray import cloudpickle
from ray.exceptions import RayChannelError, RayChannelTimeoutError
from ray.experimental.channel.common import ChannelInterface, ChannelOutputType
from ray.experimental.channel.shared_memory_channel import SharedMemoryType

from actors import wire
from actors.channel_wait import RUNG_WAIT_S, _Bell, _Ringer

# Segments live in /dev/shm where it has room: a container's default 64 MB would fill up, and a write
# to a mapped page tmpfs cannot back kills the process (SIGBUS), so elsewhere they go to the temp dir
# (page cache, the same speed until memory is short). Every file's space is reserved when it is made
# (`posix_fallocate`): a full file system fails that write with an error, never a signal.
SHM_DIR = "/dev/shm"
MIN_SHM_FREE_BYTES = 1 << 30
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
_PREFIX = "specgraph-chan-"  # then the writing process's pid, a dash, a unique id
_HEADER = struct.Struct("<QQQQQ")  # written, read, closed, length, generation
_WRITTEN, _READ, _CLOSED, _LENGTH = 0, 8, 16, 24  # byte offsets of header fields written alone
_U64 = struct.Struct("<Q")
_LENGTH_GENERATION = struct.Struct("<QQ")  # from _LENGTH
INITIAL_BYTES = 1 << 20  # a step's result at 16 requests is ~40 KB; a larger value moves to a larger file
# The writer's wait for the reader to take the previous value: in the step graph the reader takes
# it long before the next is written, so this is a guard, polled in naps that double to a cap.
_WRITER_PAUSE_S, _WRITER_MAX_PAUSE_S = 20e-6, 1e-3
# A reader's first naps before its doorbell has rung once (the writer finds the reader's pipe on its
# first ring after the reader created it), as channel_wait's reads.
_READER_PAUSE_S, _READER_MAX_PAUSE_S = 20e-6, 500e-6


def _pickle(value) -> bytes:
    """The step batches go packed (actors.wire); an error value Ray writes (a RayTaskError subclass
    made at run time) needs cloudpickle."""
    try:
        return wire.dumps(value)
    except (pickle.PicklingError, TypeError, AttributeError):
        return cloudpickle.dumps(value, protocol=5)


class ShmChannel(ChannelInterface):
    """One writer, one reader in another process of the same node. Built by the writer's process;
    the reader gets a pickled copy (the segment's name) and maps the segment on its first use."""

    def __init__(self, name: str | None = None):
        if name is None:  # the writer's side builds the segment
            remove_stale_segments()
            name = os.path.join(segment_dir(), f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
            _create_file(_path(name, 0), _HEADER.size + INITIAL_BYTES)
        self.name = name  # the control segment's path
        self._control = None  # mmap of the control segment
        self._payload = None  # (generation, mmap, offset of the payload in it)
        self._bell = None
        self._bell_lock = threading.Lock()  # a close from another thread rings it while a read waits
        self._ringer = None
        self._taken = 0  # values this process read (as the reader)

    def __reduce__(self):
        return ShmChannel, (self.name,)

    def _header(self) -> mmap.mmap:
        if self._control is None:
            try:
                self._control = _map_file(_path(self.name, 0))
            except FileNotFoundError:  # closed (and removed) before this process mapped it
                raise RayChannelError("Channel closed.") from None
        return self._control

    def _area(self, generation: int) -> tuple[mmap.mmap, int]:
        """The payload area of `generation`: (mapping, offset)."""
        if self._payload is None or self._payload[0] != generation:
            if self._payload is not None and self._payload[0] != 0:
                self._payload[1].close()
            self._payload = ((0, self._header(), _HEADER.size) if generation == 0
                             else (generation, _map_file(_path(self.name, generation)), 0))
        return self._payload[1], self._payload[2]

    def ensure_registered_as_writer(self) -> None:
        self._header()

    def ensure_registered_as_reader(self) -> None:
        self._header()

    def write(self, value, timeout: float | None = None) -> None:
        data = _pickle(value)
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        control = self._header()
        pause = _WRITER_PAUSE_S
        while True:
            written, read, closed, _, generation = _HEADER.unpack_from(control, 0)
            if closed:
                raise RayChannelError("Channel closed.")
            if read == written:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise RayChannelTimeoutError("The reader did not take the previous value in time.")
            time.sleep(pause)
            pause = min(2 * pause, _WRITER_MAX_PAUSE_S)
        area, offset = self._area(generation)
        if offset + len(data) > len(area):
            generation += 1
            _create_file(_path(self.name, generation), max(2 * (len(area) - offset), len(data)))
            if generation > 1:
                os.unlink(_path(self.name, generation - 1))  # the reader keeps its mapping until it moves
            area, offset = self._area(generation)
        area[offset:offset + len(data)] = data
        _LENGTH_GENERATION.pack_into(control, _LENGTH, len(data), generation)
        _U64.pack_into(control, _WRITTEN, written + 1)  # publishes the value
        self._ring()

    def read(self, timeout: float | None = None):
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        control = self._header()
        pause = _READER_PAUSE_S
        while True:
            written, _, closed, length, generation = _HEADER.unpack_from(control, 0)
            if written > self._taken:
                area, offset = self._area(generation)
                data = bytes(area[offset:offset + length])
                self._taken = written
                _U64.pack_into(control, _READ, written)  # the writer may reuse the slot now
                return pickle.loads(data)
            if closed:
                with self._bell_lock:
                    if self._bell is not None:
                        self._bell.remove()
                        self._bell = None
                raise RayChannelError("Channel closed.")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RayChannelTimeoutError("No value was written in time.")
            if self._bell is None:
                with self._bell_lock:
                    self._bell = _Bell(os.path.basename(self.name))
            wait = RUNG_WAIT_S if self._bell.rung else pause
            self._bell.wait(wait if deadline is None else min(wait, deadline - now))
            pause = min(2 * pause, _READER_MAX_PAUSE_S)

    def release_buffer(self, timeout: float | None = None) -> None:
        self.read(timeout)

    def _ring(self) -> None:
        if self._ringer is None:
            self._ringer = _Ringer(os.path.basename(self.name))
        self._ringer.ring()

    def close(self) -> None:
        """Fail every wait on the channel, on either side, now and from now on; remove its files
        (mappings outlive their names) and this process's doorbell."""
        try:
            control = self._header()
        except RayChannelError:
            return
        _U64.pack_into(control, _CLOSED, 1)
        self._ring()
        self._ringer.close()
        with self._bell_lock:
            if self._bell is not None:  # wake a read of this process's own: it sees the flag and ends
                os.write(self._bell.fd, b"\0")
        generation = _HEADER.unpack_from(control, 0)[4]
        for path in {_path(self.name, 0), _path(self.name, generation)}:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def segment_dir() -> str:
    try:
        stat = os.statvfs(SHM_DIR)
        if stat.f_frsize * stat.f_bavail >= MIN_SHM_FREE_BYTES:
            return SHM_DIR
    except OSError:
        pass
    return tempfile.gettempdir()


def remove_stale_segments() -> None:
    """Remove the segments whose writing process is gone (a killed actor never closes its own);
    a reader still mapping one keeps its mapping."""
    for directory in {SHM_DIR, tempfile.gettempdir()}:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith(_PREFIX):
                pid = name[len(_PREFIX):].partition("-")[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    try:
                        os.unlink(os.path.join(directory, name))
                    except FileNotFoundError:
                        pass


class ShmChannelType(ChannelOutputType):
    """Type hint for a compiled-graph edge: our channel where it serves (one reader, another
    process, the same node), Ray's shared-memory channel elsewhere."""

    def create_channel(self, writer, reader_and_node_list, driver_actor_id=None):
        node = ray.get_runtime_context().get_node_id()
        if _ORDERED_STORES and len(reader_and_node_list) == 1:
            reader, reader_node = reader_and_node_list[0]
            if reader_node == node and (writer is None or reader != writer):
                return ShmChannel()
        return SharedMemoryType().create_channel(writer, reader_and_node_list, driver_actor_id)


def _path(name: str, generation: int) -> str:
    return name if generation == 0 else f"{name}.{generation}"


def _create_file(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _map_file(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)
