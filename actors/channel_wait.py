"""Compiled-graph channel reads that sleep while they wait, woken by the writer.

Ray 2.60's shared-memory channel read (PlasmaObjectHeader::ReadAcquire) spins with
sched_yield until the writer's value arrives (ray#55128): every actor of a compiled graph
waiting for its input, and the process waiting for the graph's output, burns a core. On a
small machine that core is the one the target computes on. `install()` replaces the read in
this process with non-blocking tries and, between them, a wait on a doorbell: a named pipe
per (channel, reading process) that the writing process rings after each write when both sit
on one node. A read then wakes when its value is written (~0.1 ms on this VM, a pipe's wake-up),
not at the end of a nap, and tries about once per value.

A try costs 30-45 us of CPU here (Python, Ray's channel, the exception of an empty read); with
naps alone (PAUSE_S doubling to `max_sleep_s`) a 45 ms step took ~100 tries: 4 CPU ms of the
scheduler's per step, on the cores the target computes on. Until a channel's doorbell has rung
once (its writer on another node, or not writing yet), its reads keep the plain backoff, so a
wait never costs more than `max_sleep_s` of latency.

A compiled graph's channel (BufferedSharedMemoryChannel) rotates over several shared-memory
buffers, one per value in flight, each with its own object id; the doorbell is named after the
first buffer's id as both sides first saw it, so one pipe serves every buffer of the channel.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import tempfile
import time

from ray.exceptions import RayChannelTimeoutError
from ray.experimental.channel import shared_memory_channel

PAUSE_S = 20e-6  # first sleep: a value that is almost there costs next to nothing
# Once a doorbell has rung, a read trusts it and waits this long between tries: a safety net
# for a ring lost to a full pipe, never the expected wake-up.
RUNG_WAIT_S = 0.5
BELL_DIR = os.path.join(tempfile.gettempdir(), f"specgraph-bells-{os.getuid()}")

_EMPTY = object()  # no value read yet (a read may return None)
_tries = 0  # one-shot channel tries this process's sleeping reads made (`tries()`)


def tries() -> int:
    """How many one-shot channel tries this process's sleeping reads have made: what waiting
    costs in CPU (a read woken by its doorbell tries about once per value)."""
    return _tries


class _Bell:
    """The reading side: a FIFO named `<channel id>.<pid>` that this process holds open
    read-write (so it never sees EOF and never blocks on open)."""

    def __init__(self, key: str):
        os.makedirs(BELL_DIR, exist_ok=True)
        self.path = os.path.join(BELL_DIR, f"{key}.{os.getpid()}")
        if not os.path.exists(self.path):
            os.mkfifo(self.path, 0o600)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        self.rung = False

    def wait(self, timeout: float) -> None:
        """Sleep until rung or `timeout` s, then drain the rings (the next try covers them all)."""
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass
            self.rung = True

    def remove(self) -> None:
        """Close and remove the FIFO (its writers see EPIPE and drop it)."""
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _Ringer:
    """The writing side: rings the FIFO of every reader of a channel after each write.
    Readers create theirs at their first wait, so the directory is looked at on each write
    until one has appeared."""

    def __init__(self, key: str):
        self.prefix = key + "."
        self.fds: list[int] = []

    def _open(self) -> None:
        try:
            names = [n for n in os.listdir(BELL_DIR) if n.startswith(self.prefix)]
        except FileNotFoundError:
            return
        for name in names:
            try:
                self.fds.append(os.open(os.path.join(BELL_DIR, name), os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: its reader is gone (a killed process's FIFO); ENOENT: removed
                pass

    def ring(self) -> None:
        if not self.fds:
            self._open()
        for fd in list(self.fds):
            try:
                os.write(fd, b"\0")
            except BlockingIOError:  # full of rings not read yet: its reader wakes anyway
                pass
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise
                os.close(fd)  # its reader exited
                self.fds.remove(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def remove_stale_bells() -> None:
    """Remove the FIFOs of reading processes that are gone (a killed actor leaves its own)."""
    try:
        names = os.listdir(BELL_DIR)
    except FileNotFoundError:
        return
    for name in names:
        pid, path = name.rpartition(".")[2], os.path.join(BELL_DIR, name)
        try:
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}") and stat.S_ISFIFO(os.stat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass


def _bell_key(channel, side: str) -> str:
    """The doorbell's name for a buffered channel: its first buffer's object id as this process
    first saw it (a resize gives a buffer a new id on the writer before the reader learns it)."""
    key = channel.__dict__.get("_bell_key")
    if key is None:
        first = channel._buffers[0]
        key = channel._bell_key = (first._writer_ref if side == "writer" else first._local_reader_ref).hex()
    return key


def install(max_sleep_s: float) -> None:
    """Make this process's channel reads sleep (up to `max_sleep_s` at a time, or until rung)
    while they wait, and its writes ring the readers' doorbells; 0 keeps Ray's spinning read.
    Call it before the graph compiles (once per process)."""
    single, buffered = shared_memory_channel.Channel, shared_memory_channel.BufferedSharedMemoryChannel
    originals = getattr(install, "originals", None) or (single.read, buffered.read, buffered.write)
    install.originals = originals
    spinning_read, _, buffered_write = originals
    if max_sleep_s <= 0:
        single.read, buffered.read, buffered.write = originals
        return
    remove_stale_bells()
    bells: dict[str, _Bell] = {}
    ringers: dict[str, _Ringer] = {}

    def sleeping_read(buffer, timeout: float | None, bell_key: str | None):
        global _tries
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        value, pause, bell = _EMPTY, PAUSE_S, None
        while value is _EMPTY:
            _tries += 1
            try:
                value = spinning_read(buffer, 0)  # 0: one try, no wait
            except RayChannelTimeoutError:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise
                if bell_key is not None:
                    bell = bell or bells.get(bell_key) or bells.setdefault(bell_key, _Bell(bell_key))
                wait = RUNG_WAIT_S if bell is not None and bell.rung else pause
                wait = wait if deadline is None else min(wait, deadline - now)
                if bell is None:
                    time.sleep(wait)
                else:
                    bell.wait(wait)
                pause = min(2 * pause, max_sleep_s)
        return value

    def read(self, timeout: float | None = None):
        """A lone channel (not one of a compiled graph's buffered ones): naps only."""
        return sleeping_read(self, timeout, None)

    def read_buffered(self, timeout: float | None = None):
        key = _bell_key(self, "reader")
        self.ensure_registered_as_reader()
        output = sleeping_read(self._buffers[self._next_read_index], timeout, key)
        self._next_read_index = (self._next_read_index + 1) % self._num_shm_buffers
        return output

    def write_buffered(self, value, timeout: float | None = None) -> None:
        key = _bell_key(self, "writer")
        buffered_write(self, value, timeout)
        ringer = ringers.get(key) or ringers.setdefault(key, _Ringer(key))
        ringer.ring()

    single.read, buffered.read, buffered.write = read, read_buffered, write_buffered
