"""Our C++ CPU kernels (models/csrc), built on first use with torch's cpp_extension.

`paged_attention.cpp` attends decode and verify passes straight over the KV pool: loops per (request,
KV head) that read its keys and values through the slot index, where the PyTorch path gathers them and
runs SDPA or batched products (~15 ops a layer). One layer's call against that path (`python -m
bench.attention --mode paged`, AMD Zen 4, avx512_bf16, 2 threads, SmolLM2's 9 / 3 heads; 1-64 requests
over 200 / 1000 keys; bench/results/attention_s49_paged_queries.json): one query a request (decode rows)
0.17-0.75x the time in bf16 and 0.10-0.55x in fp32; 2-16 queries a request (verify trees, the draft's
extends) 0.22-1.06x and 0.15-0.92x. Longer queries (prompt chunks after a prefix) go to that path's
operator (`specgraph::paged_attention`), at run time, inside the one operator a compiled graph calls.

The build takes ~15 s once per machine (torch's extension cache, ~/.cache/torch_extensions, keeps it),
compiled for this CPU (-march=native; the cache entry is named for the CPU's flags). Where it fails
(no C++ compiler), attention stays on the PyTorch path, with a warning. Runners turn it on for their
model with `use_attention_kernel` (EngineConfig.torch_compile), per model: attention in other models
of the process is left as it is.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from models.layers import Attention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# -ffast-math lets the compiler vectorize the softmax's exp and the sums (reassociated: results move by
# float rounding, as between PyTorch's own kernels); the source keeps every value finite.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction sets: a -march=native build must not run on another CPU."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def load_attention_kernel() -> bool:
    """Build (or load from the cache) and register `specgraph_kernels::paged_attention`; False, with a
    warning, where that fails."""
    from torch.utils.cpp_extension import load

    try:
        if shutil.which("ninja") is None:  # the venv's own (a dependency), where its bin is not on PATH
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        load(name=f"specgraph_kernels_{_cpu_tag()}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
             is_python_module=False)
    except Exception as exc:  # no compiler, or one that rejects the flags: the PyTorch path serves
        log.warning("CPU attention kernel: building %s failed, attention stays on PyTorch's path: %s", SOURCE.name, exc)
        return False

    @torch.library.register_fake("specgraph_kernels::paged_attention")
    def _(q, k, v, k_cache, v_cache, out_slots, kv_index, mask, q_index, out_rows, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)  # (T, Hq, D)

    return True


def use_attention_kernel(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Route `model`'s attention (passes attending in one piece) through the kernel, on CPU in fp32 or
    bf16; False where it does not apply or could not be built."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not load_attention_kernel():
        return False
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = True
    return True
