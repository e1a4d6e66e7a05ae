"""Shared fixtures: tiny random models on disk (session-scoped, built once)."""

from __future__ import annotations

import pytest

from bench.random_models import make_eagle, make_eagle3, make_hot_vocab, make_llama


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    """vocab 64, hidden 64, 4 layers, GQA 4/2, tied embeddings."""
    return make_llama(tiny_dir / "target", seed=0)


@pytest.fixture(scope="session")
def tiny_standalone(tiny_dir):
    """A narrower draft LM (hidden 32 vs the target's 64) with the same vocabulary."""
    return make_llama(tiny_dir / "standalone", hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, seed=5)


@pytest.fixture(scope="session")
def tiny_standalone_hot(tiny_dir, tiny_standalone):
    """tiny_standalone proposing only the even ids (32 of 64): a hot vocabulary."""
    return make_hot_vocab(tiny_dir / "standalone_hot", tiny_standalone, list(range(0, 64, 2)))


@pytest.fixture(scope="session")
def tiny_eagle3_shared(tiny_dir, tiny_target):
    """EAGLE-3 head as wide as the target (64), sharing its embeddings."""
    return make_eagle3(tiny_dir / "eagle3_shared", tiny_target, hidden=64)


@pytest.fixture(scope="session")
def tiny_eagle3_own(tiny_dir, tiny_target):
    """EAGLE-3 head of hidden 32 with its own embeddings and a draft vocab of 32 (d2t/t2d)."""
    return make_eagle3(tiny_dir / "eagle3_own", tiny_target, hidden=32, draft_vocab=32, own_embeddings=True)


@pytest.fixture(scope="session")
def tiny_eagle(tiny_dir, tiny_target):
    return make_eagle(tiny_dir / "eagle", tiny_target)
