"""Turn a model name or path into a loaded module: registry names, Hugging Face folders
(config.json + safetensors, sharded or not) and .gguf files (converted once, through
transformers' GGUF support, to safetensors in a cache folder). Safetensors only: pickled
checkpoints are refused."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.registry import REGISTRY, PackagedGGUF, RepoFolder, REPO_ROOT

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A missing or malformed checkpoint; the message names the file and the field."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECGRAPH_CACHE") or Path.home() / ".cache" / "specgraph")


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Registry name, HF folder or .gguf file -> a folder with config.json and safetensors."""
    name = str(name_or_path)
    entry = REGISTRY.get(name)
    if isinstance(entry, PackagedGGUF):
        spec = importlib.util.find_spec(entry.package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"model {name!r} needs the package {entry.package!r}: {entry.install_hint}")
        gguf = Path(list(spec.submodule_search_locations)[0]) / entry.filename
        return _converted_gguf(gguf, cache_dir() / name)
    if isinstance(entry, RepoFolder):
        return _check_folder(REPO_ROOT / entry.path)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: GGUF file not found")
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted_gguf(path, cache_dir() / f"{path.stem}-{key}")
    if path.is_dir():
        return _check_folder(path)
    known = ", ".join(sorted(REGISTRY))
    raise CheckpointError(f"model {name!r} is neither a registered name ({known}), a folder, nor a .gguf file")


def _check_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder / 'config.json'}: missing (a model folder needs config.json)")
    if not ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()):
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {pickled}: pickled checkpoints are not loaded, convert them to safetensors)" if pickled else ""
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    return folder


def _converted_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF once into `out` (config.json, model.safetensors, tokenizer files)."""
    if (out / SINGLE_FILE).is_file():
        return out
    if not gguf.is_file():
        raise CheckpointError(f"{gguf}: GGUF file not found")
    with _file_lock(out.with_name(out.name + ".lock")):
        if (out / SINGLE_FILE).is_file():
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    return out


def load_config(folder: Path) -> Any:
    """The folder's config.json as a transformers config object."""
    from transformers import AutoConfig

    path = folder / "config.json"
    try:
        json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


class TensorSource:
    """Lazy access to the tensors of a folder's safetensors file(s), sharded or not."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: malformed, needs a 'weight_map' ({exc})") from None
        else:
            with safe_open(folder / SINGLE_FILE, framework="pt") as handle:
                weight_map = {k: SINGLE_FILE for k in handle.keys()}
        self.weight_map: dict[str, str] = weight_map

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _file(self, name: str) -> Path:
        file = self.folder / self.weight_map[name]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {INDEX_FILE} for {name!r})")
        return file

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self._file(name), framework="pt") as handle:
            return handle.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file header, without reading the tensor."""
        with safe_open(self._file(name), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())


def checkpoint_names(module_names, available: set[str], aliases) -> dict[str, str]:
    """module name -> the checkpoint's name for it: the first of `aliases(name)` (spellings in
    order of preference) the checkpoint holds; names it holds under none are left out."""
    found = {}
    for name in module_names:
        for alias in aliases(name):
            if alias in available:
                found[name] = alias
                break
    return found


def load_weights(
    module: torch.nn.Module,
    source: TensorSource,
    dtype: torch.dtype,
    optional: set[str] = frozenset(),
    rename: dict[str, str] | None = None,
    dry_run: bool = False,
) -> set[str]:
    """Assign checkpoint tensors to a module built on the meta device; returns the names
    that were optional and absent (the caller fills them). Checks every name and shape.

    rename maps module names to checkpoint names where they differ. dry_run: check names and
    shapes from the files' headers only, reading and assigning no tensor.
    """
    rename = rename or {}
    expected = {k: v for k, v in module.state_dict(keep_vars=True).items()}
    available = source.keys()
    wanted_names = {rename.get(k, k) for k in expected}
    unexpected = sorted(available - wanted_names)
    if unexpected:
        raise CheckpointError(f"{source.folder}: unexpected tensor(s) {unexpected[:5]} for this architecture")
    absent: set[str] = set()
    state = {}
    for name, current in expected.items():
        ckpt_name = rename.get(name, name)
        if ckpt_name not in available:
            if name in optional:
                absent.add(name)
                continue
            raise CheckpointError(f"{source.folder}: tensor {ckpt_name!r} missing from the checkpoint")
        shape = source.shape(ckpt_name)
        if shape != tuple(current.shape):
            raise CheckpointError(
                f"{source.folder}: tensor {ckpt_name!r} has shape {shape}, the config implies {tuple(current.shape)}"
            )
        if not dry_run:
            tensor = source.get(ckpt_name)
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if not dry_run:
        module.load_state_dict(state, strict=False, assign=True)
    return absent
