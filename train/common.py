"""Shared by the trainers: sequences from `train.data` output, target features (aux hidden
states and top-k logits, computed with our own target forward, once and cached as safetensors
shards or per batch on each worker with --online-features), token-frequency vocabularies,
batching, logs, plots, model cards."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.attention import AttentionMetadata
from models.build import ModelSource, build_target
from models.packed import pack_linears

DEFAULT_DATA = Path(os.environ.get("SPECGRAPH_CACHE") or Path.home() / ".cache" / "specgraph") / "train"
# What a standalone draft folder carries of its target besides weights (it loads as a model of its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


# ---- sequences ------------------------------------------------------------------------

@dataclass
class Sequence:
    tokens: list[int]  # prompt + response
    num_prompt: int  # loss on positions >= num_prompt (the target's own tokens)
    group: str = ""  # prompt id: every answer to one prompt lands on the same side of the split


def load_sequences(data_dir: Path, max_len: int = 512, modes: tuple[str, ...] | None = None) -> list[Sequence]:
    """Records of `responses.jsonl` as sequences, truncated to max_len, deterministic order."""
    out = []
    path = Path(data_dir) / "responses.jsonl"
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if modes and not any(r["mode"].startswith(m) for m in modes):
            continue
        tokens = (r["prompt_ids"] + r["output_ids"])[:max_len]
        if len(tokens) - len(r["prompt_ids"]) < 2:
            continue
        out.append(Sequence(tokens, len(r["prompt_ids"]), str(r["id"])))
    return out


def _unit_hash(text: str) -> float:
    return zlib.crc32(text.encode()) / 2**32


def split_holdout(seqs: list[Sequence], frac: float, seed: int = 0) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out) by a hash of each sequence's prompt id, not by position: a prompt's greedy,
    sampled and follow-up answers stay together, and a sequence keeps its side when the data grows
    (more `train.data` output never moves a trained-on sequence into the held-out set)."""
    hashes = {s.group: _unit_hash(f"{seed}/{s.group}") for s in seqs}
    held = {g for g, h in hashes.items() if h < frac}
    if frac > 0 and not held and len(hashes) > 1:
        held = {min(hashes, key=hashes.get)}  # tiny data sets still get a held-out group
    return [s for s in seqs if s.group not in held], [s for s in seqs if s.group in held]


def token_counts(seqs: list[Sequence], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(response counts, prompt counts) per target id, each (V,)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    prompt_counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.tokens[s.num_prompt:]), minlength=vocab_size)
        prompt_counts += torch.bincount(torch.tensor(s.tokens[: s.num_prompt]), minlength=vocab_size)
    return counts, prompt_counts


def vocab_coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of response tokens (counts (V,) from `token_counts`) whose id is in `ids`: what a
    draft vocabulary can predict."""
    return float(counts[ids].sum()) / max(1, int(counts.sum()))


def draft_vocab(counts: torch.Tensor, prompt_counts: torch.Tensor, draft_vocab_size: int,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """The draft_vocab_size target ids most frequent as predicted (response) tokens, topped up
    with prompt tokens and then the lowest ids (BPE merge order); sorted. Counts from `token_counts`.
    `keep` (ids) are in it whatever their counts: a grown vocabulary keeps the one its head has."""
    vocab_size = counts.numel()
    # Lexicographic score: response count, then prompt count, then small id first.
    score = counts.double() * 1e9 + prompt_counts.double().clamp_max(1e8) + (1 - torch.arange(vocab_size) / vocab_size)
    if keep is not None:
        score[keep] = float("inf")
    return score.topk(min(draft_vocab_size, vocab_size)).indices.sort().values


# ---- target features ------------------------------------------------------------------

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
    # topk_* and aux are None in a token-only shard until `featurize` fills them in.


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


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, looked up once; None where the C library has none."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def trim_heap() -> None:
    """Hand the pages glibc's heap holds free back to the OS (a no-op without glibc). Batches come
    in many (B, T) shapes, so a CPU step's freed activations leave the heap fragmented and the
    resident memory of a run grew by ~50 MB per step (a `--max-len 2048` run passed 14 GB and Ray's
    OOM monitor killed a two-worker one); the training loop trims every few steps (train/loop.py)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def steps_in_budget(total: int, step: int, per_step_s: float, remaining_s: float, margin: float = 0.9) -> int:
    """The step count that ends a run now at `step` within `remaining_s` seconds (a `margin` share
    of it, the rest left for evals and checkpoints), never more than `total` nor fewer than `step`."""
    return max(step, min(total, step + int(margin * max(0.0, remaining_s) / max(per_step_s, 1e-9))))


def lr_at(step: int, total: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- logs, plots, cards ---------------------------------------------------------------

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


# ---- what both trainers' prepare() share -----------------------------------------------

SAVE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def data_dirs(args) -> list[Path]:
    """--data: one `train.data` folder or several, comma-separated, read in that order."""
    return [Path(d).expanduser() for d in args.data.split(",") if d]


def load_split(args) -> tuple[list[Sequence], list[Sequence]]:
    """The run's (training, held-out) sequences from --data, --max-len, --modes, --max-sequences, --holdout."""
    modes = tuple(args.modes.split(",")) if args.modes else None
    seqs = [s for folder in data_dirs(args) for s in load_sequences(folder, args.max_len, modes)]
    train, held = split_holdout(seqs, args.holdout, args.seed)
    # Cap the training side alone: runs on more or less data measure on one held-out set, and
    # the first shards of features are those of the whole data's (content-named), so reused.
    return (train[: args.max_sequences] if args.max_sequences else train), held


def compute_features(args, aux_layer_ids: list[int] | None, train_seqs: list[Sequence],
                     held_seqs: list[Sequence]) -> FeatureSet:
    """Target feature shards (train, held-out), cached under the first --data folder's features/.
    Both trainers pass the target's aux ids, so one target pass serves both. With
    --online-features nothing is computed here: the sequences go to token-only shards in the work
    dir and every worker runs the target itself on each batch (a GPU does that in a fraction of a
    step, with no storage)."""
    if args.online_features:
        folder = work_dir(args)
        folder.mkdir(parents=True, exist_ok=True)
        held = [token_shard(held_seqs, folder / "tokens-held.safetensors")] if held_seqs else []
        return FeatureSet([token_shard(train_seqs, folder / "tokens-train.safetensors")], held,
                          {"aux_ids": aux_layer_ids, "topk": args.topk, "dtype": args.feature_dtype})
    torch.set_num_threads(args.threads * max(1, args.num_workers if not args.no_ray else 1))
    gpu = args.use_gpu and torch.cuda.is_available()
    featurizer = TargetFeaturizer(args.target, aux_layer_ids, args.topk, device="cuda" if gpu else "cpu",
                                  dtype=getattr(torch, args.feature_dtype))
    # A GPU forward is cheap and mostly launch overhead at 2K tokens: give it bigger ragged batches.
    budget = 32768 if gpu else 2048
    # Shards hold consecutive sequences and are named by content, so a folder added after
    # another costs the features of its own sequences (and of one shared shard) alone.
    cache = data_dirs(args)[0] / "features"
    shards = cache_features(featurizer, train_seqs, cache, token_budget=budget, desc="target features (train)")
    held = cache_features(featurizer, held_seqs, cache, token_budget=budget, desc="target features (held-out)") \
        if held_seqs else []
    return FeatureSet(shards, held)


def write_data_info(state_dir: Path, train_seqs: list[Sequence], held_seqs: list[Sequence], init_from: str = "",
                    **extra) -> None:
    """data_info.json (read by the model card) and the same line on stdout."""
    info = {"sequences": len(train_seqs), "held_out_sequences": len(held_seqs),
            "tokens": sum(len(s.tokens) for s in train_seqs),
            "response_tokens": sum(len(s.tokens) - s.num_prompt for s in train_seqs), **extra}
    if init_from:
        info["init_from"] = str(Path(init_from).expanduser())
    (Path(state_dir) / "data_info.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


def worker_config(args, kind: str, state_dir: Path, features: FeatureSet, ttt_steps: int, decay: float) -> dict:
    """The config `train.loop.train_loop` runs on every worker."""
    return {
        "kind": kind, "out": str(Path(args.out).resolve()), "state_dir": str(Path(state_dir).resolve()),
        "target": args.target, "shards": [str(p) for p in features.shards],
        "held_shards": [str(p) for p in features.held], "online": features.online,
        "epochs": args.epochs, "max_steps": args.max_steps, "max_minutes": args.max_minutes,
        "token_budget": args.token_budget, "lr": args.lr,
        "warmup": args.warmup, "ttt_steps": ttt_steps, "decay": decay, "seed": args.seed, "threads": args.threads,
        "resume": args.resume, "save_every": args.save_every, "eval_every": args.eval_every,
        "use_gpu": args.use_gpu, "amp": args.amp, "save_dtype": SAVE_DTYPES[args.save_dtype],
        "use_ray": not args.no_ray,
    }


def parse_training_args(parser, argv=None):
    """Parse a trainer's command line; `auto` dtypes become what the training device runs natively
    (bf16 on a GPU or an AMX / AVX512-BF16 CPU; on an AVX2-only CPU emulated bf16 is slower than
    fp32), so the model card and the feature cache record the dtype actually used."""
    from actors.device import auto_dtype

    args = parser.parse_args(argv)
    gpu = args.use_gpu and torch.cuda.is_available()
    native = auto_dtype(torch.device("cuda" if gpu else "cpu")) == torch.bfloat16
    if args.feature_dtype == "auto":
        args.feature_dtype = "bfloat16" if native else "float32"
    if args.amp == "auto":
        args.amp = "bf16" if native else "off"
    return args


def add_data_args(p, max_len: int, data_help: str = "train.data output folder, or several comma-separated") -> None:
    """The options `load_split` reads: which train.data records, cut how, split how."""
    p.add_argument("--data", default=str(DEFAULT_DATA / "smollm2"), help=data_help)
    p.add_argument("--modes", default="", help="comma list of record modes to use (greedy,t); default all")
    p.add_argument("--max-sequences", type=int, default=0,
                   help="use the first N sequences of the training side (the held-out set stays whole; 0: all)")
    p.add_argument("--max-len", type=int, default=max_len)
    p.add_argument("--holdout", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)


def add_training_args(p, lr: float) -> None:
    """The command-line options every draft trainer shares (data, schedule, workers, resume, eval)."""
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="", help="the draft's name, the model card's title (default: the --out folder's name)")
    add_data_args(p, max_len=512, data_help="train.data output folder, or several comma-separated (features cached "
                                            "under the first)")
    p.add_argument("--topk", type=int, default=32, help="target logits kept per position (soft labels)")
    p.add_argument("--feature-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="dtype of the target forward that computes features and labels (auto: bfloat16 where "
                        "the training device runs it natively, as `--dtype auto` serves; float32 elsewhere)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="wall-clock budget of the command, data loading and features included: after a few "
                        "steps the step count is cut to end within it, the learning-rate schedule run to its end "
                        "(0: no budget)")
    p.add_argument("--token-budget", type=int, default=2048, help="padded tokens per batch per worker")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-dtype", default="bf16", choices=list(SAVE_DTYPES))
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"],
                   help="bf16 autocast for forward/backward (fp32 master weights); ~2x on CPUs with AMX/AVX512-BF16 "
                        "(auto: bf16 where the training device runs it natively, off elsewhere)")
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--online-features", action="store_true",
                   help="compute target features per batch on each worker instead of caching them on disk "
                        "(no feature storage; meant for GPU workers, where the target forward is cheap)")
    p.add_argument("--no-ray", action="store_true", help="run the loop in this process (debugging)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", default="", metavar="DIR",
                   help="start from a trained draft folder's weights (fine-tune on new data); its architecture is "
                        "kept, so --hidden and the like are ignored, and so is its draft vocabulary unless "
                        "--draft-vocab-size asks for another (train.eagle3: only a larger one)")
    p.add_argument("--work-dir", default="", help="optimizer state, logs, Ray files (default: cache/train/runs/<out name>)")
    p.add_argument("--eval-prompts", default="", help="jsonl of held-out prompts: measure acceptance after training")
    p.add_argument("--eval-n", type=int, default=40)
    p.add_argument("--eval-max-tokens", type=int, default=128)


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


def work_dir(args) -> Path:
    """Where a trainer keeps optimizer state, logs and Ray files (outside the shipped draft)."""
    return Path(args.work_dir).expanduser() if args.work_dir else DEFAULT_DATA / "runs" / Path(args.out).name
