"""The training loop shared by the trainers: one Ray Train worker (`TorchTrainer`, DDP over
gloo on CPU or NCCL on GPU), or the whole job in-process with `--no-ray`. Rank 0 logs,
evaluates on held-out sequences, and writes resumable state plus the draft folder."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from train import cli, features, runlog


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



def _batch_plan(shards: list[str], token_budget: int, epoch_seed: int, world: int) -> list[list[int]]:
    from safetensors import safe_open

    lens = []
    for path in shards:
        with safe_open(path, framework="pt") as handle:
            lens += handle.get_tensor("lens").tolist()

    class _Len:
        def __init__(self, n):
            self.tokens = range(n)

    batches = features.make_batches([_Len(n) for n in lens], token_budget, epoch_seed)
    usable = len(batches) - len(batches) % world
    return batches[:usable]


def train_loop(cfg: dict) -> None:
    """Runs on every worker: its share of the batches, DDP when world > 1, rank 0 checkpoints."""
    torch.set_num_threads(cfg["threads"])
    if cfg["use_ray"]:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
    else:
        rank, world = 0, 1
    out, state_dir = Path(cfg["out"]), Path(cfg["state_dir"])
    state_path = state_dir / "state.pt"
    # The trainer's own builder (`build_for_loop` of train.eagle3 / train.standalone), passed in
    # the config so that this shared loop imports neither trainer.
    model, inner, save = cfg["build"](cfg, state_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    step, elapsed, tokens = 0, 0.0, 0
    if cfg["resume"] and state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        inner.load_state_dict(state["model"], strict=False)
        optim.load_state_dict(state["optim"])
        step, elapsed, tokens = state["step"], state["elapsed"], state.get("tokens", 0)
        if rank == 0:
            runlog.truncate_log(state_dir / "log.jsonl", step)
    if cfg["use_ray"]:
        model = ray.train.torch.prepare_model(model, move_to_device=False)
    device = torch.device("cpu")
    if cfg["use_gpu"] and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        model.to(device)

    plans = [_batch_plan(cfg["shards"], cfg["token_budget"], cfg["seed"] + e, world) for e in range(cfg["epochs"])]
    per_epoch = len(plans[0]) // world
    total_steps = per_epoch * cfg["epochs"]
    if cfg["max_steps"]:
        total_steps = min(total_steps, cfg["max_steps"])
    needed = {i for plan in plans for bi, batch in enumerate(plan) if bi % world == rank for i in batch}
    with_aux = cfg["kind"] == "eagle3"
    examples = dict(zip(sorted(needed), features.load_examples(cfg["shards"], keep=lambda i: i in needed, with_aux=with_aux)))
    held = features.load_examples(cfg["held_shards"], with_aux=with_aux) if cfg["held_shards"] and rank == 0 else []
    featurizer = None
    if cfg["online"]:
        spec = cfg["online"]
        # Aux states only for heads that read them: a standalone student needs the logits alone.
        featurizer = features.TargetFeaturizer(cfg["target"], spec["aux_ids"] if with_aux else None, spec["topk"],
                                             device=device, dtype=getattr(torch, spec["dtype"]))

    log_path = state_dir / "log.jsonl"
    timer = runlog.Timer(elapsed)
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc=cfg["kind"], mininterval=10, file=sys.stdout)

    def make_batch(items: list[features.Example]) -> dict[str, torch.Tensor]:
        if featurizer is not None:
            return features.pad_batch(features.featurize(featurizer, items, with_aux), device)
        return {k: v.to(device) for k, v in features.pad_batch(items).items()}

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["amp"] == "bf16")

    def evaluate():
        module = model.module if hasattr(model, "module") else model
        module.eval()
        sums = [[0.0, 0.0, 0] for _ in range(cfg["ttt_steps"])]
        with torch.no_grad():
            for i in range(0, len(held), 8):
                with autocast():
                    _, stats = module(make_batch(held[i : i + 8]))
                for s, (l, a, n) in zip(sums, stats):
                    s[0] += l * n
                    s[1] += a * n
                    s[2] += n
        module.train()
        loss = sum(cfg["decay"] ** k * s[0] / max(1, s[2]) for k, s in enumerate(sums))
        return {"loss": loss, "acc": [s[1] / max(1, s[2]) for s in sums]}

    def checkpoint(final=False):
        if rank != 0:
            return
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": inner.state_dict(), "optim": optim.state_dict(), "step": step,
                    "elapsed": timer.elapsed, "tokens": tokens}, tmp)
        os.replace(tmp, state_path)
        save(out, torch.float32 if not final else cfg["save_dtype"])
        runlog.plot_losses(log_path, out / "loss.png", f"{cfg['kind']} draft for {cfg['target']}")

    def keep():
        """--keep-every: a copy of the draft as it is now, for measuring acceptance against the
        response tokens trained on (the curve that sizes the next data round)."""
        folder = state_dir / "checkpoints" / f"step-{step:06d}"
        save(folder, cfg["save_dtype"])
        (folder / "checkpoint.json").write_text(json.dumps({"step": step, "response_tokens": tokens}))

    # --max-minutes: time steps fit_from..fit_at of this run (the first ones warm up kernels and
    # caches), then cut total_steps so the rest ends by the deadline, a tenth kept for evals and saves.
    deadline, fit_from, fit_at = cfg.get("deadline", 0), step + 5, step + 25
    fit_start = time.time()
    model.train()
    while step < total_steps:
        epoch, index = divmod(step, per_epoch)
        batch_ids = plans[epoch][index * world + rank]
        batch = make_batch([examples[i] for i in batch_ids])
        # Response tokens (loss positions) this step trains on, over every worker.
        seen = batch["loss_mask"].sum()
        if cfg["use_ray"] and world > 1:
            torch.distributed.all_reduce(seen)
        tokens += int(seen)
        for group in optim.param_groups:
            group["lr"] = lr_at(step, total_steps, cfg["lr"], cfg["warmup"])
        with autocast():
            loss, stats = model(batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        # Every 8th step: a 2048-token CPU run then held 5.2 GB at step 96 instead of 9.4 GB, at the
        # same 1.65 s/step; trimming after every step cost ~15% in page faults.
        if device.type == "cpu" and step % 8 == 0:
            trim_heap()
        if deadline and step == fit_from:
            fit_start = time.time()
        if deadline and step == fit_at:
            per_step = (time.time() - fit_start) / (fit_at - fit_from)
            total_steps = steps_in_budget(total_steps, step, per_step, deadline - time.time())
            if cfg["use_ray"] and world > 1:
                agreed = torch.tensor([total_steps], device=device)  # NCCL needs it on the GPU
                torch.distributed.broadcast(agreed, 0)  # every rank stops at rank 0's count
                total_steps = int(agreed)
            if rank == 0:
                bar.total = total_steps
                print(f"--max-minutes {cfg['max_minutes']}: {per_step * 1000:.0f} ms/step, training {total_steps} steps")
        record = {"kind": "train", "step": step, "epoch": epoch, "loss": float(loss.detach()),
                  "loss_k": [s[0] for s in stats], "acc_k": [s[1] for s in stats],
                  "lr": optim.param_groups[0]["lr"], "tokens": tokens, "time": round(timer.elapsed, 1)}
        if rank == 0:
            runlog.append_log(log_path, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=",".join(f"{s[1]:.2f}" for s in stats))
        last = step == total_steps
        if cfg["use_ray"] and (step % cfg.get("report_every", 25) == 0 or last):
            ray.train.report({k: v for k, v in record.items() if k != "kind"})
        if rank == 0 and (step % cfg["save_every"] == 0 or last):
            if held and (step % cfg["eval_every"] == 0 or last):
                runlog.append_log(log_path, {"kind": "eval", "step": step, **evaluate()})
            checkpoint(final=last)
        if rank == 0 and cfg.get("keep_every") and (step % cfg["keep_every"] == 0 or last):
            keep()
    if rank == 0:
        bar.close()
        if step >= total_steps and not (out / "model.safetensors").is_file():
            checkpoint(final=True)


def run(cfg: dict, num_workers: int, started: float) -> None:
    """Trains on `num_workers` Ray Train workers (or in this process with --no-ray); --max-minutes
    counts from `started`, the command's start, so data loading and features are inside it."""
    cfg = dict(cfg, deadline=started + cfg["max_minutes"] * 60 if cfg["max_minutes"] else 0)
    if not cfg["use_ray"]:
        train_loop(cfg)
        return
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=max(num_workers, 2), include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cfg["threads"])}})
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=cfg,
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=cfg["use_gpu"],
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=str(Path(cfg["state_dir"]) / "ray"), name=cfg["kind"]),
        )
        trainer.fit()
    finally:
        if started:
            ray.shutdown()


def report(args, start: float, kind: str, algorithm: str, eval_steps: int) -> dict:
    """After training: measure acceptance on held-out prompts (if given), write the run
    summary and the draft's model card, print the summary."""
    out = Path(args.out)
    summary = {"wall_s": round(time.time() - start, 1)}
    if args.eval_prompts:
        from train.evaluate import measure_acceptance

        summary["acceptance"] = measure_acceptance(args.target, str(out), algorithm, args.eval_prompts, args.eval_n,
                                                   args.eval_max_tokens, num_steps=eval_steps,
                                                   dtype=args.feature_dtype)
    (cli.work_dir(args) / "summary.json").write_text(json.dumps(summary, indent=2))
    from train.card import write_card

    write_card(out, cli.work_dir(args), kind, args.target, vars(args))
    print(json.dumps(summary))
    return summary
