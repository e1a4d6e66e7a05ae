"""A local engine in a process of its own, driven over a pipe, so that configs compared in one run
each own their process.

In one process, engines built earlier step slower: three identical `none` engines stepped in turns
at 37.7 / 37.1 / 36.8 ms (batch 1, fp32), and the same two engines read 0.958x or 1.052x of each
other by which was built first (docs/benchmarks.md, sessions 19 and 24; the cause is not found, part
of it where each KV pool's memory landed). A server runs one engine per process, so a benchmark that
gives each engine a process of its own measures what a user gets, with no build order to cancel.

An idle engine process waits on its pipe and takes no CPU. Its OpenMP threads spin for a while after
their last parallel region before they sleep (libgomp's `GOMP_SPINCOUNT`), so each call starts after a
pause (`SETTLE_S`) that keeps the previous engine's spin out of the next engine's timed turn. The Ray
backend's engines compute in actor processes of their own already and are driven from the caller's
process (`InDriver`).
"""

from __future__ import annotations

import multiprocessing
import time
import traceback

SETTLE_S = 0.1


def _serve(conn, config, threads: int | None, warm_up) -> None:
    """The child: build the engine, warm it with `warm_up(engine)`, then run `fn(engine, *args)` for
    each (fn, args) received until None comes."""
    import torch

    from graphs import build_graph

    if threads:
        torch.set_num_threads(threads)
    engine = None
    try:
        engine = build_graph(config)
        warm_up(engine)
        conn.send(("ok", None))
        while (task := conn.recv()) is not None:
            fn, args = task
            try:
                conn.send(("ok", fn(engine, *args)))
            except Exception:  # the caller raises it; the engine stays up for the next task
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if engine is not None:
            engine.shutdown()
        conn.close()


class EngineProcess:
    """`build_graph(config)` in a process of its own; `call(fn, *args)` runs `fn(engine, *args)` there
    (fn and args pickled: module-level functions and plain data) and returns its result."""

    def __init__(self, config, threads: int | None, warm_up):
        # Forked from a server process that has imported torch and the engine's modules and run nothing
        # (no OpenMP team to inherit half-made): 1.4 s of imports once, not per engine.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["graphs"])
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, config, threads, warm_up), daemon=True)
        self._process.start()
        child.close()
        self._reply()  # built and warm, or its error raised here

    def _reply(self):
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"engine process exited (code {self._process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"in the engine process:\n{value}")
        return value

    def call(self, fn, *args):
        time.sleep(SETTLE_S)
        self._conn.send((fn, args))
        return self._reply()

    def shutdown(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()


class InDriver:
    """`EngineProcess`'s interface over an engine built in this process (the Ray backend's)."""

    def __init__(self, config, warm_up):
        from graphs import build_graph

        self.engine = build_graph(config)
        warm_up(self.engine)

    def call(self, fn, *args):
        return fn(self.engine, *args)

    def shutdown(self) -> None:
        self.engine.shutdown()


def start_engine(config, threads: int | None, warm_up, own_process: bool = True):
    """The engine of `config` warmed by `warm_up(engine)`: a local one in a process of its own unless
    `own_process` is False (quick runs, a profiler on one process)."""
    if own_process and config.backend == "local":
        return EngineProcess(config, threads, warm_up)
    return InDriver(config, warm_up)
