"""Free loopback ports for test servers, outside 10002-19999 where Ray puts its workers."""

from __future__ import annotations

import socket


def free_port(low: int, high: int, taken: tuple[int, ...] = ()) -> int:
    for port in range(low, high):
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {low}-{high}")
