"""Standalone draft LM distilled from the target (same vocabulary, KL to the target's
distribution on the target's own answers).

    python -m train.standalone --target smollm2-135m-instruct --out drafts/smollm2-135m-instruct-standalone \
        [--hidden 256 --layers 4 --heads 4 --kv-heads 2 --intermediate 768] [--epochs 2] [--resume]
        [--draft-vocab-size 8192]

The student is a small Llama with tied embeddings initialised from the target's embedding
matrix projected onto its top `hidden` principal directions. Saved as a Hugging Face folder
(config.json + model.safetensors + the target's tokenizer files) that
`models.build.build_draft(STANDALONE, ...)` loads. Training runs under Ray Train like
`train.eagle3` (shared loop in `train.loop`); target features come from the same cache.
The student learns the whole vocabulary; `--draft-vocab-size` then has it propose only the ids
the target writes most (`train.hot_vocab`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from spec.vocab import vocab_ids
from train import checkpoints, cli, loop, sequences
from train.hot_vocab import hot_ids, with_hot_vocab


def student_config(target_cfg: dict, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": target_cfg["vocab_size"],
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": intermediate,
        "hidden_act": "silu", "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-5),
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 4096), "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False,
    }
    for key in ("rope_parameters", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id"):
        if target_cfg.get(key) is not None:
            config[key] = target_cfg[key]
    return config


def projected_embeddings(embed: torch.Tensor, hidden: int) -> torch.Tensor:
    """(V, Ht) -> (V, hidden): the target embeddings on their top principal directions, rescaled
    to the target's per-row norm scale."""
    centered = embed - embed.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(centered[:: max(1, embed.shape[0] // 8192)], full_matrices=False)
    basis = vh[:hidden].T  # (Ht, h)
    out = embed @ basis
    if out.shape[1] < hidden:
        out = torch.cat([out, torch.randn(embed.shape[0], hidden - out.shape[1]) * 0.02], dim=1)
    return out * (embed.norm(dim=1).mean() / out.norm(dim=1).mean().clamp_min(1e-6))


def new_student(state_dir: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((Path(state_dir) / "config.json").read_text())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    init = torch.load(Path(state_dir) / "init.pt", weights_only=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(init["embed"])
    if "weights" in init:
        checkpoints.load_warm_weights(model, init["weights"], {"lm_head.weight"})  # tied to the embeddings
    model.tie_weights()
    return model


def save_student(model, state_dir: Path, out: Path, dtype: torch.dtype) -> None:
    out = Path(out)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to the embeddings
    config = json.loads((Path(state_dir) / "config.json").read_text())
    vocab = Path(state_dir) / "draft_vocab.pt"
    if vocab.is_file():
        config, state = with_hot_vocab(config, state, torch.load(vocab, weights_only=True))
    checkpoints.write_draft(out, state, config, dtype)
    target = Path(json.loads((Path(state_dir) / "target.json").read_text())["folder"])
    for name in checkpoints.TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, out / name)


class DistillModel(nn.Module):
    """forward(batch) -> (soft CE to the target's top-k distribution on response tokens, stats)."""

    def __init__(self, student):
        super().__init__()
        self.student = student

    def forward(self, batch: dict[str, torch.Tensor]):
        tokens, valid, loss_mask = batch["tokens"], batch["valid"], batch["loss_mask"]
        hidden = self.student.model(input_ids=tokens, attention_mask=valid.long()).last_hidden_state  # (B, T, H)
        # Position p predicts token p+1; learn where p+1 is a response token.
        sel = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1) & valid
        logits = self.student.lm_head(hidden[sel]).float()  # (N, V)
        probs = batch["topk_logits"][sel].softmax(-1)
        logp = F.log_softmax(logits, -1).gather(-1, batch["topk_ids"][sel])
        loss = -(probs * logp).sum(-1).mean()
        acc = (logits.argmax(-1) == batch["topk_ids"][sel][:, 0]).float().mean()
        return loss, [(float(loss.detach()), float(acc), int(sel.sum()))]


def build_for_loop(cfg: dict, state_dir: Path):
    """`train.loop`'s builder: (DistillModel over the student, the student, save(out, dtype))."""
    student = new_student(state_dir)
    return DistillModel(student), student, lambda out, dtype: save_student(student, state_dir, out, dtype)


def prepare(args) -> dict:
    from models.build import ModelSource
    from models.loader import TensorSource
    from spec.shapes import get_target_aux_layer_ids

    state_dir = cli.work_dir(args)
    state_dir.mkdir(parents=True, exist_ok=True)
    target = ModelSource.resolve(args.target)
    target_cfg = json.loads((target.folder / "config.json").read_text())
    train_seqs, held_seqs = cli.load_split(args)
    vocab_size = target_cfg["vocab_size"]
    counts, prompt_counts = sequences.token_counts(train_seqs, vocab_size)
    if not (args.resume and (state_dir / "config.json").is_file()):
        hot = None  # the ids the draft will propose (sorted), or None for all
        if args.init_from:
            config, weights = checkpoints.warm_start(args.init_from, {"vocab_size": vocab_size})
            if "d2t" in weights:  # its hot vocabulary, kept unless --draft-vocab-size asks for another
                hot = vocab_ids(weights.pop("d2t"))
            config.pop("draft_vocab_size", None)
            init = {"embed": weights["model.embed_tokens.weight"], "weights": weights}
        else:
            config = student_config(target_cfg, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
            embed = TensorSource(target.folder).get("model.embed_tokens.weight").float()
            init = {"embed": projected_embeddings(embed, args.hidden)}
        if args.draft_vocab_size:
            hot = hot_ids(counts, prompt_counts, args.draft_vocab_size)
        torch.save(init, state_dir / "init.pt")
        (state_dir / "config.json").write_text(json.dumps(config, indent=2))
        (state_dir / "target.json").write_text(json.dumps({"folder": str(target.folder)}))
        for stale in ("log.jsonl", "state.pt", "draft_vocab.pt"):
            (state_dir / stale).unlink(missing_ok=True)
        if hot is not None:
            torch.save(hot, state_dir / "draft_vocab.pt")
    # The student needs no aux states; the same aux ids as train.eagle3 keep one shared feature cache.
    feature_set = cli.compute_features(args, get_target_aux_layer_ids(target.config, None), train_seqs, held_seqs)
    c = json.loads((state_dir / "config.json").read_text())
    vocab = {}
    if (state_dir / "draft_vocab.pt").is_file():
        hot = torch.load(state_dir / "draft_vocab.pt", weights_only=True)
        vocab = {"draft_vocab_size": hot.numel(), "draft_vocab_coverage": round(sequences.vocab_coverage(counts, hot), 4)}
    cli.write_data_info(state_dir, train_seqs, held_seqs, args.init_from,
                           student=f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
                                   f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, "
                                   f"intermediate {c['intermediate_size']}, tied embeddings", **vocab)
    return cli.worker_config(args, "standalone", build_for_loop, state_dir, feature_set, ttt_steps=1, decay=1.0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_training_args(p, lr=2e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--eval-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="propose only the N ids the target writes most in the data (its LM head keeps their rows; "
                        "see train.hot_vocab); 0: the whole vocabulary, or with --init-from the draft's own")
    return p


def main(argv=None) -> None:
    args = cli.parse_training_args(parser(), argv)
    start = time.time()
    cfg = prepare(args)
    loop.run(cfg, args.num_workers, start)
    loop.report(args, start, "standalone", "STANDALONE", args.eval_steps)


if __name__ == "__main__":
    main()
