"""Per-runner device, dtype and thread settings (CUDA when this process was given a GPU)."""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def check_dtype_name(name: str | torch.dtype) -> None:
    if not isinstance(name, torch.dtype) and str(name).lower() not in (*DTYPES, "auto"):
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")


def auto_dtype(device: torch.device) -> torch.dtype:
    """The fastest dtype the hardware runs natively: bf16 on CUDA (fp16 before Ampere) and on
    CPUs with AMX or AVX512-BF16 (where verifying 8 tokens costs ~1.1x one, against ~1.5-2x in
    fp32: `python -m bench.runner --dtype float32,bfloat16`); fp32 elsewhere (on an AVX2-only CPU
    bf16 is emulated: its products run widened to fp32 or, for one row, on plain bf16 `F.linear`
    (`models.packed`), and the rest converts as it goes; only plain decoding of one request, which
    reads half the weight bytes, runs faster than fp32: 23.8 against 15.8 tokens/s, where `make
    serve`'s trees ran 21.0 against 24.9, docs/benchmarks.md session 42)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if native_bf16_cpu() else torch.float32


def native_bf16_cpu() -> bool:
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def parse_dtype(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    check_dtype_name(name)
    if isinstance(name, torch.dtype):
        return name
    if str(name).lower() == "auto":
        return auto_dtype(torch.device(device))
    dtype = DTYPES[str(name).lower()]
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_bf16_cpu():
        _warn_emulated_bf16()
    return dtype


@functools.cache  # once per process: the config and every runner parse the same dtype
def _warn_emulated_bf16() -> None:
    log.warning("dtype bfloat16: this CPU has no native bf16 (AMX or AVX512-BF16), so bf16 is emulated (matrix "
                "products widened to float32, 1.5x float32's weight memory) and, but for one request decoding "
                "without speculation, no faster than float32 here; dtype 'auto' picks float32 on it")


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def set_threads(num_threads: int | None) -> None:
    """The calling thread's torch threads. OpenMP keeps the team size per calling thread, so this
    runs where the runner will compute (Ray actors: actors.compute_thread)."""
    if num_threads:
        torch.set_num_threads(num_threads)
