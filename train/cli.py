"""What both trainers' command lines share: the options, the data split they name, the target
features they compute, and the config `train.loop` runs on every worker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from train.checkpoints import SAVE_DTYPES
from train.features import FeatureSet, TargetFeaturizer, cache_features, token_shard
from train.sequences import Sequence, load_sequences, split_holdout


DEFAULT_DATA = Path(os.environ.get("SPECGRAPH_CACHE") or Path.home() / ".cache" / "specgraph") / "train"


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


def worker_config(args, kind: str, build, state_dir: Path, features: FeatureSet, ttt_steps: int, decay: float) -> dict:
    """The config `train.loop.train_loop` runs on every worker; `build(cfg, state_dir)` is the
    trainer's builder of (trainable module, inner model, save), passed so the loop imports no trainer."""
    return {
        "kind": kind, "build": build, "out": str(Path(args.out).resolve()), "state_dir": str(Path(state_dir).resolve()),
        "target": args.target, "shards": [str(p) for p in features.shards],
        "held_shards": [str(p) for p in features.held], "online": features.online,
        "epochs": args.epochs, "max_steps": args.max_steps, "max_minutes": args.max_minutes,
        "token_budget": args.token_budget, "lr": args.lr,
        "warmup": args.warmup, "ttt_steps": ttt_steps, "decay": decay, "seed": args.seed, "threads": args.threads,
        "resume": args.resume, "save_every": args.save_every, "keep_every": args.keep_every, "eval_every": args.eval_every,
        "use_gpu": args.use_gpu, "amp": args.amp, "save_dtype": SAVE_DTYPES[args.save_dtype],
        "use_ray": not args.no_ray,
    }


def parse_training_args(parser, argv=None):
    """Parse a trainer's command line; `auto` dtypes become what the training device runs natively
    (bf16 on a GPU or an AMX / AVX512-BF16 CPU; on an AVX2-only CPU emulated bf16 is slower than
    fp32), so the model card and the feature cache record the dtype actually used."""
    from actors.device import auto_dtype

    args = parser.parse_args(argv)
    if args.keep_every < 0:
        parser.error(f"--keep-every must be 0 (off) or a step count, got {args.keep_every}")
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
    p.add_argument("--keep-every", type=int, default=0,
                   help="also keep the draft every N steps and at the end, under WORK_DIR/checkpoints/step-N with the "
                        "response tokens trained on so far (0: only the latest, in --out)")
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


def work_dir(args) -> Path:
    """Where a trainer keeps optimizer state, logs and Ray files (outside the shipped draft)."""
    return Path(args.work_dir).expanduser() if args.work_dir else DEFAULT_DATA / "runs" / Path(args.out).name

