"""A training run's log (one JSON record a line, truncated on resume), its loss plot and timer."""

from __future__ import annotations

import json
import time
from pathlib import Path


def append_log(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop records past `step`: a resumed run restarts from its last checkpoint, so the steps an
    interrupted run logged after it are trained (and logged) again."""
    records = [r for r in read_log(path) if r.get("step", 0) <= step]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def read_log(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_losses(log_path: Path, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(log_path)
    train = [r for r in rows if r.get("kind") == "train"]
    held = [r for r in rows if r.get("kind") == "eval"]
    if not train:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in train]
    window = max(1, len(train) // 50)
    smooth = [sum(r["loss"] for r in train[max(0, i - window + 1) : i + 1]) / len(train[max(0, i - window + 1) : i + 1])
              for i in range(len(train))]
    ax.plot(steps, [r["loss"] for r in train], alpha=0.25, color="C0")
    ax.plot(steps, smooth, color="C0", label="train loss")
    if held:
        ax.plot([r["step"] for r in held], [r["loss"] for r in held], "o-", color="C1", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


class Timer:
    def __init__(self, elapsed: float = 0.0):
        self.start = time.time() - elapsed

    @property
    def elapsed(self) -> float:
        return time.time() - self.start

