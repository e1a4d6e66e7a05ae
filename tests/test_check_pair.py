"""`python -m graphs.check_pair TARGET DRAFT`: the startup checks of a pair, from configs and
checkpoint headers only, printed for a person; exit code 2 on a mismatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench.random_models import make_eagle3, make_llama

from graphs.check_pair import MISMATCH_EXIT_CODE, main
from models.loader import TensorSource

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Fail if any weight is read: the check works on configs and file headers alone."""
    def refuse(self, name):
        raise AssertionError(f"check_pair read the tensor {name}")

    monkeypatch.setattr(TensorSource, "get", refuse)


def test_agreed_shapes_are_printed(tiny_target, tiny_eagle3_own, no_tensor_reads, capsys):
    assert main([str(tiny_target), str(tiny_eagle3_own)]) == 0  # the algorithm comes from the draft
    out = capsys.readouterr().out
    assert out.startswith("ok: ")
    for line in ("algorithm: EAGLE3", "draft_input_width: 192", "draft_hidden_size: 32", "draft_vocab_size: 32",
                 "eagle_aux_hidden_state_layer_ids: [1, 1, 0]", "target_model_type: llama"):
        assert f"  {line}\n" in out, line


def test_standalone_pair(tiny_target, tiny_standalone, no_tensor_reads, capsys):
    assert main([str(tiny_target), str(tiny_standalone), "--algorithm", "standalone"]) == 0
    out = capsys.readouterr().out
    assert "  algorithm: STANDALONE\n" in out and "  draft_input_width: None\n" in out


def test_algorithm_that_does_not_fit_the_draft(tiny_target, tiny_eagle3_own, capsys):
    assert main([str(tiny_target), str(tiny_eagle3_own), "--algorithm", "EAGLE"]) == MISMATCH_EXIT_CODE
    out = capsys.readouterr().out
    assert out.startswith("mismatch: ") and "'architectures'" in out and "EAGLE3 draft" in out


def test_head_for_another_target_exits_2(tiny_target, tmp_path):
    """A head trained for a 48-wide target, checked against the 64-wide one, from the command line."""
    other = make_llama(tmp_path / "other", hidden=48, layers=4, heads=4, kv_heads=2)
    head = make_eagle3(tmp_path / "head", other, hidden=32)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-m", "graphs.check_pair", str(tiny_target), str(head), "--algorithm",
                          "EAGLE3"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert run.returncode == MISMATCH_EXIT_CODE, run.stderr
    assert run.stdout == ("mismatch: target_hidden_size: EAGLE3 draft declares target_hidden_size 48, "
                          "but the target's hidden_size is 64\n")
