"""A hot vocabulary for a standalone draft LM (as FR-Spec): the draft proposes only the
`--draft-vocab-size` ids the target writes most often in the data, so its LM head keeps those
rows only. In a small draft the head is most of the weights each draft step reads (SmolLM2's
4-layer, 256-wide draft: 49152 x 256 of its 16M parameters), and the draft's other ids were
rarely accepted anyway. Verification is unchanged, so outputs stay the target's own.

    python -m train.hot_vocab drafts/smollm2-135m-instruct-standalone --out DIR --draft-vocab-size 8192 \\
        --data ~/.cache/specgraph/train/magpie,~/.cache/specgraph/train/docs

DIR gets the draft's weights (unchanged) plus `d2t` (`spec.vocab`), its config with
`draft_vocab_size`, its tokenizer files, and a card: the vocabulary's size and coverage of the
data's response tokens, then the draft's own card. Frequencies come from the training side of
the data's held-out split (`--holdout`, as the trainers split it). `train.standalone
--draft-vocab-size` does the same when it writes a draft it trained.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from spec.vocab import vocab_maps
from train import checkpoints, cli, sequences
from train.average import source_card


def hot_ids(counts: torch.Tensor, prompt_counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The draft_vocab_size ids the target writes most (counts from `sequences.token_counts`), sorted."""
    if not 1 <= draft_vocab_size <= counts.numel():
        raise ValueError(f"--draft-vocab-size: {draft_vocab_size} must be between 1 and the vocab_size {counts.numel()}")
    return sequences.draft_vocab(counts, prompt_counts, draft_vocab_size)


def with_hot_vocab(config: dict, state: dict[str, torch.Tensor], ids: torch.Tensor) -> tuple[dict, dict]:
    """A standalone draft's (config, tensors) proposing only `ids`: `draft_vocab_size` and `d2t`.
    The full vocabulary (every id) writes neither, so the folder stays a plain Llama checkpoint."""
    config = {k: v for k, v in config.items() if k != "draft_vocab_size"}
    state = {k: v for k, v in state.items() if k != "d2t"}
    if ids.numel() < config["vocab_size"]:
        config["draft_vocab_size"] = ids.numel()
        state["d2t"] = vocab_maps(ids, config["vocab_size"])[0]
    return config, state


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("draft", help="a standalone draft folder (config.json + model.safetensors)")
    p.add_argument("--out", required=True)
    p.add_argument("--draft-vocab-size", type=int, required=True)
    cli.add_data_args(p, max_len=2048)
    p.add_argument("--name", default="", help="the card's title (default: the --out folder's name)")
    args = p.parse_args(argv)
    draft, out = Path(args.draft).expanduser(), Path(args.out).expanduser()
    if draft.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the draft folder; write the new draft to a new folder")
    config, state = checkpoints.read_draft(draft, "draft")
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"draft: {draft} has architectures {config.get('architectures')}, not a standalone "
                         "LlamaForCausalLM draft (an EAGLE-3 head's draft vocabulary is set when it is trained)")
    train_seqs, _ = cli.load_split(args)
    if not train_seqs:
        raise ValueError(f"--data: no sequences in {args.data}")
    counts, prompt_counts = sequences.token_counts(train_seqs, config["vocab_size"])
    ids = hot_ids(counts, prompt_counts, args.draft_vocab_size)
    coverage = sequences.vocab_coverage(counts, ids)
    config, state = with_hot_vocab(config, state, ids)
    dtype = getattr(torch, config.pop("torch_dtype", None) or "float32")
    checkpoints.write_draft(out, state, config, dtype)
    for name in checkpoints.TOKENIZER_FILES:
        if (draft / name).is_file():
            shutil.copy(draft / name, out / name)
    info = {"draft_vocab_size": ids.numel(), "vocab_size": config["vocab_size"], "coverage": round(coverage, 4),
            "sequences": len(train_seqs), "response_tokens": sum(len(s.tokens) - s.num_prompt for s in train_seqs)}
    lines = [f"# {args.name or out.name}", "", f"`{draft}` proposing only its {ids.numel()} most frequent ids "
             "(`python -m train.hot_vocab`; weights unchanged, `d2t` added):", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += [f"| data | `{args.data}` |", "", f"## The draft: `{draft}`", "", source_card(draft, out, "draft-"), ""]
    (out / "README.md").write_text("\n".join(lines))
    print(json.dumps({"out": str(out), **info}))


if __name__ == "__main__":
    main()
