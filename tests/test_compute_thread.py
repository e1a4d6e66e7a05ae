"""A Ray runner actor keeps one OpenMP team whichever thread Ray calls it from
(actors.compute_thread): a second team makes libgomp sleep its workers between parallel regions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.compute_thread import ComputeThread

ROOT = Path(__file__).resolve().parent.parent

# Runs in a fresh process (OpenMP teams live for the process): the runner's threads are set on
# the compute thread, then work arrives from the main thread and from a second thread (a Ray
# compiled graph's), each asking libgomp how many threads it runs with, as matmuls do. The
# second caller stays alive while the process's threads are counted: had it run the work itself,
# its own OpenMP team's worker would be alive beside it.
CALLERS = """
import ctypes, os, threading, torch
from actors.compute_thread import ComputeThread
from actors.device import set_threads
gomp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
x = torch.randn(256, 256)
def work():
    for _ in range(20):
        x @ x  # a parallel region: starts the calling thread's OpenMP team
    return gomp.omp_get_max_threads()
def os_threads():
    return len(os.listdir("/proc/self/task"))
compute = ComputeThread()
compute.run(set_threads, 2)
seen = [compute.run(work)]
before = os_threads()
worked, finish = threading.Event(), threading.Event()
def caller():
    seen.append(compute.run(work))
    worked.set()
    finish.wait()
t = threading.Thread(target=caller)
t.start(); worked.wait()
print(seen, os_threads() - before)
finish.set(); t.join()
"""


def test_work_from_any_thread_runs_in_one_openmp_team_with_the_runners_threads():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # as Ray sets it for actors
    out = subprocess.run([sys.executable, "-c", CALLERS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # Both callers ran with the 2 threads set on the compute thread, and the second caller added
    # only itself to the process; running in the callers' own threads would have seen 1
    # (OMP_NUM_THREADS) and started a team per caller.
    assert out.stdout.split() == ["[2,", "2]", "1"]


def test_results_and_errors_come_back_to_the_caller():
    compute = ComputeThread()
    assert compute.run(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ValueError, match="bad field"):
        compute.run(lambda: (_ for _ in ()).throw(ValueError("bad field")))
    assert compute.run(compute.run, lambda: 7) == 7  # a call from the compute thread itself runs inline
