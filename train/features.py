"""Target features for draft training: aux hidden states and top-k logits computed with our own
target forward, cached once as content-named safetensors shards (or per batch on each worker with
--online-features), and the ragged batches the trainers read them in."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.attention import AttentionMetadata
from models.build import ModelSource, build_target
from models.packed import pack_linears
from train.sequences import Sequence


class TargetFeaturizer:
    """Our own target forward (same code as serving) over whole sequences, batched as ragged
    requests: aux hidden states (inputs of `aux_layer_ids`) and the top-k logits per position.
    bf16 by default: what a bf16 server feeds the draft (packed linears included, as the
    runners pack them), and ~3x faster than fp32 with AMX."""

    def __init__(self, target: str, aux_layer_ids: list[int] | None, topk: int = 32, device="cpu",
                 dtype: torch.dtype = torch.bfloat16):
        self.source = ModelSource.resolve(target)
        self.model = build_target(self.source, dtype, device)
        pack_linears(self.model, dtype, device)
        self.aux_ids = aux_layer_ids
        self.topk = topk
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]], to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """Features of the concatenated sequences: topk_logits (N, K) half, topk_ids (N, K) int,
        aux (N, A) half; on the CPU (for the cache) or left on this featurizer's device (online)."""
        # The numerics are self.dtype's, also when called inside a training loop's autocast.
        with torch.autocast(torch.device(self.device).type, enabled=False):
            return self._features(seqs, to_cpu)

    def _features(self, seqs: list[list[int]], to_cpu: bool) -> dict[str, torch.Tensor]:
        lens = [len(s) for s in seqs]
        total = sum(lens)
        kv = self.model.make_kv_pool(total, self.dtype, self.device)
        slots = list(torch.arange(total).split(lens))
        positions = torch.cat([torch.arange(n) for n in lens])
        meta = AttentionMetadata.build([torch.zeros(0, dtype=torch.long)] * len(seqs), slots, positions,
                                       [None] * len(seqs), self.device)
        ids = torch.tensor([t for s in seqs for t in s], device=self.device)
        hidden, aux = self.model(ids, meta, kv, self.aux_ids)
        top_vals, top_ids = [], []
        for chunk in hidden.split(256):
            values, index = self.model.logits(chunk).float().topk(self.topk, dim=-1)
            top_vals.append(values.half())
            top_ids.append(index.int())
        out = {"topk_logits": torch.cat(top_vals), "topk_ids": torch.cat(top_ids)}
        if aux is not None:
            out["aux"] = aux.half()
        return {k: v.cpu() for k, v in out.items()} if to_cpu else out


def _digest(*parts) -> str:
    import hashlib

    h = hashlib.sha256()
    for part in parts:
        h.update(json.dumps(part).encode())
    return h.hexdigest()[:16]


def cache_features(featurizer: TargetFeaturizer, seqs: list[Sequence], cache_dir: Path, shard_size: int = 64,
                   token_budget: int = 2048, desc: str = "target features") -> list[Path]:
    """Compute features for every sequence once. Shards of `shard_size` consecutive sequences are
    named by a hash of their contents (under a folder per target and feature settings), so a
    rerun, an interrupted run, or a run on grown data (new records are appended) computes only
    the shards it has not seen."""
    from tqdm import tqdm

    cache_dir = Path(cache_dir) / _digest(featurizer.source.folder.name, featurizer.aux_ids, featurizer.topk,
                                          str(featurizer.dtype))
    cache_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    bar = tqdm(total=sum(len(s.tokens) for s in seqs), desc=desc, unit="tok", mininterval=10)
    for start in range(0, len(seqs), shard_size):
        part = seqs[start : start + shard_size]
        path = cache_dir / f"{_digest(*[[s.num_prompt, s.tokens] for s in part])}.safetensors"
        shards.append(path)
        if not path.is_file():
            pieces: list[dict[str, torch.Tensor]] = []
            group: list[list[int]] = []
            for s in part + [None]:
                if s is None or (group and sum(map(len, group)) + len(s.tokens) > token_budget):
                    pieces.append(featurizer(group))
                    group = []
                if s is not None:
                    group.append(s.tokens)
            tensors = {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]} | token_tensors(part)
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, path)
        bar.update(sum(len(s.tokens) for s in part))
    bar.close()
    return shards


def token_tensors(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    """What every shard holds besides features: tokens (N,) flat, num_prompt and lens per sequence."""
    return {"tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.long),
            "num_prompt": torch.tensor([s.num_prompt for s in seqs]),
            "lens": torch.tensor([len(s.tokens) for s in seqs])}


def token_shard(seqs: list[Sequence], path: Path) -> Path:
    """A shard of tokens alone (no features), for --online-features."""
    save_file(token_tensors(seqs), str(path))
    return path


@dataclass
class FeatureSet:
    """What the training loop reads: shards holding cached features, or token-only shards plus
    what each worker needs to compute the features itself, batch by batch, on its own device."""

    shards: list[Path]
    held: list[Path]
    online: dict | None = None  # {"aux_ids", "topk", "dtype"} of the worker's TargetFeaturizer


@dataclass
class Example:
    tokens: torch.Tensor  # (T,) long
    loss_mask: torch.Tensor  # (T,) bool: position holds a response token
    topk_ids: torch.Tensor | None  # (T, K) int: the target's top-k for the token AFTER each position
    topk_logits: torch.Tensor | None  # (T, K) half
    aux: torch.Tensor | None  # (T, A) half


def load_examples(shards: list[Path], keep=lambda i: True, with_aux: bool = True) -> list[Example]:
    out, index = [], 0
    for path in shards:
        t = load_file(str(path))
        offset = 0
        for n, p in zip(t["lens"].tolist(), t["num_prompt"].tolist()):
            if keep(index):
                sl = slice(offset, offset + n)
                mask = torch.zeros(n, dtype=torch.bool)
                mask[p:] = True
                has = "topk_ids" in t
                out.append(Example(t["tokens"][sl].long(), mask, t["topk_ids"][sl] if has else None,
                                   t["topk_logits"][sl] if has else None,
                                   t["aux"][sl] if with_aux and "aux" in t else None))
            offset += n
            index += 1
    return out


def featurize(featurizer: TargetFeaturizer, examples: list[Example], with_aux: bool = True) -> list[Example]:
    """Token-only examples -> the same examples with features, in one target forward over all of
    them, left on the featurizer's device."""
    feats = featurizer([e.tokens.tolist() for e in examples], to_cpu=False)
    out, offset = [], 0
    for e in examples:
        sl = slice(offset, offset + len(e.tokens))
        out.append(Example(e.tokens, e.loss_mask, feats["topk_ids"][sl], feats["topk_logits"][sl],
                           feats["aux"][sl] if with_aux and "aux" in feats else None))
        offset += len(e.tokens)
    return out


def make_batches(examples: list[Example], token_budget: int, seed: int) -> list[list[int]]:
    """Length-bucketed batches of about token_budget padded tokens, shuffled by seed."""
    rng = random.Random(seed)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].tokens), rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        n = len(examples[i].tokens)
        if current and max(longest, n) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def pad_batch(examples: list[Example], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """(B, T, ...) tensors on `device`, right-padded to the longest example."""
    b, t = len(examples), max(len(e.tokens) for e in examples)
    k = examples[0].topk_ids.shape[1]
    out = {
        "tokens": torch.zeros(b, t, dtype=torch.long, device=device),
        "valid": torch.zeros(b, t, dtype=torch.bool, device=device),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool, device=device),
        "topk_ids": torch.zeros(b, t, k, dtype=torch.long, device=device),
        "topk_logits": torch.full((b, t, k), -1e4, dtype=torch.float32, device=device),
    }
    if examples[0].aux is not None:
        out["aux"] = torch.zeros(b, t, examples[0].aux.shape[1], dtype=torch.float32, device=device)
    for i, e in enumerate(examples):
        n = len(e.tokens)
        out["tokens"][i, :n] = e.tokens
        out["valid"][i, :n] = True
        out["loss_mask"][i, :n] = e.loss_mask
        out["topk_ids"][i, :n] = e.topk_ids.long()
        out["topk_logits"][i, :n] = e.topk_logits.float()
        if e.aux is not None:
            out["aux"][i, :n] = e.aux.float()
    return out


def soft_targets(topk_ids: torch.Tensor, topk_logits: torch.Tensor, t2d_index: torch.Tensor,
                 draft_vocab_size: int) -> torch.Tensor:
    """(..., K) target top-k -> (..., Vd) distribution over the draft vocab (entries outside the
    draft vocab are dropped and the rest renormalised). t2d_index: target id -> draft id or -1."""
    draft_ids = t2d_index[topk_ids]  # (..., K)
    logits = topk_logits.masked_fill(draft_ids < 0, -1e4)
    probs = logits.softmax(-1)
    out = torch.zeros(*topk_ids.shape[:-1], draft_vocab_size, dtype=probs.dtype, device=probs.device)
    return out.scatter_add_(-1, draft_ids.clamp_min(0), probs * (draft_ids >= 0))

