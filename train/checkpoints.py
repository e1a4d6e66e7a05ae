"""Draft folders on disk: reading, checking and writing a trained draft's config and weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# What a standalone draft folder carries of its target besides weights (it loads as a model of its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


SAVE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def read_draft(folder: str | Path, flag: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights with floating tensors in fp32) of a draft folder `write_draft` wrote;
    `flag` names the argument that gave the folder in the error when a file is missing."""
    folder = Path(folder).expanduser()
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ValueError(f"{flag}: {folder / name} not found (expected a draft folder written by "
                             "train.eagle3, train.standalone or train.average)")
    config = json.loads((folder / "config.json").read_text())
    weights = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
    return config, weights


def warm_start(folder: str, expect: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """--init-from: (config, float weights) of a draft folder this trainer wrote, checked against
    `expect` (config field, dotted for nested ones -> the value this target needs) so a head for
    another target fails here, naming the field, instead of training on mismatched shapes."""
    config, weights = read_draft(folder, "--init-from")
    config.pop("torch_dtype", None)
    for field, want in expect.items():
        have = config
        for part in field.split("."):
            have = have.get(part) if isinstance(have, dict) else None
        if have != want:
            raise ValueError(f"--init-from {Path(folder).expanduser()}: config field {field} is {have!r}, "
                             f"this target needs {want!r}")
    return config, weights


def write_draft(out: Path, state: dict[str, torch.Tensor], config: dict, dtype: torch.dtype) -> None:
    """A draft folder's weights and config: floating tensors cast to `dtype` (index tensors such as
    d2t / t2d kept), written under a temporary name and renamed so that a server loading the folder
    never reads half a file; config.json records the dtype."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().cpu().to(dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in state.items()}
    save_file(state, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    os.chmod(out / "model.safetensors", 0o644)
    (out / "config.json").write_text(json.dumps(dict(config, torch_dtype=str(dtype).replace("torch.", "")), indent=2))


def load_warm_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], may_lack: set[str]) -> None:
    """Copies a warm start's weights into a freshly built model; every other tensor it has must be
    in `may_lack` (what the trainer does not save, e.g. embeddings shared from the target)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = set(missing) - may_lack
    if missing or unexpected:
        raise ValueError(f"--init-from: weights do not fit the model (missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)})")

