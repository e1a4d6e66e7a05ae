"""Model cards (README.md) for trained drafts: data size, steps, wall time, losses, acceptance."""

from __future__ import annotations

import json
from pathlib import Path

from train.runlog import read_log


def write_card(out: Path, state: Path, kind: str, target: str, args: dict) -> None:
    out, state = Path(out), Path(state)
    info = json.loads((state / "data_info.json").read_text()) if (state / "data_info.json").is_file() else {}
    summary = json.loads((state / "summary.json").read_text()) if (state / "summary.json").is_file() else {}
    log = read_log(state / "log.jsonl")
    train = [r for r in log if r.get("kind") == "train"]
    held = [r for r in log if r.get("kind") == "eval"]
    last = train[-20:]
    title = {"eagle3": "EAGLE-3 head", "standalone": "Standalone draft LM"}[kind]
    lines = [f"# {args.get('name') or out.name}", "", f"{title} for `{target}`, trained in this repository (`python -m train.{kind}`)",
             "by self-distillation on the target's own answers to prompts written here (`train/prompts.py`) or by",
             "the target itself (`train/magpie.py`), generated with our engine (`python -m train.data`). No",
             "benchmark data (Spec-Bench) was used for training, tuning or choosing prompts; `train.decontam`",
             "drops any prompt overlapping it and `tests/test_train.py` checks that.", ""]
    lines += ["## Training", "", "| | |", "|---|---|"]
    for key, value in info.items():
        lines.append(f"| {key} | {value} |")
    if train:
        lines.append(f"| optimizer steps | {train[-1]['step']} |")
        lines.append(f"| epochs | {train[-1]['epoch'] + 1} |")
        lines.append(f"| training wall time (s) | {train[-1]['time']} |")
        lines.append(f"| final train loss (mean of last {len(last)} steps) | {sum(r['loss'] for r in last) / len(last):.4f} |")
        if "acc_k" in last[-1]:
            accs = [sum(r["acc_k"][k] for r in last) / len(last) for k in range(len(last[-1]["acc_k"]))]
            lines.append(f"| final train top-1 agreement per draft step | {', '.join(f'{a:.3f}' for a in accs)} |")
    if held:
        lines.append(f"| final held-out loss | {held[-1]['loss']:.4f} |")
        if "acc" in held[-1]:
            lines.append(f"| final held-out top-1 agreement per step | {', '.join(f'{a:.3f}' for a in held[-1]['acc'])} |")
    if summary.get("wall_s"):
        lines.append(f"| total wall time of the command (s) | {summary['wall_s']} |")
    keep = ["epochs", "max_steps", "lr", "token_budget", "ttt_steps", "decay", "draft_vocab_size", "num_workers",
            "threads", "hidden", "layers", "temperature", "max_len", "topk", "amp", "feature_dtype", "use_gpu",
            "online_features", "no_ray", "max_minutes", "only_new_rows"]
    flags = {k: args[k] for k in keep if k in args and args[k] not in (None, "", 0)}
    if flags.get("no_ray"):
        flags.pop("num_workers", None)  # --no-ray trains in this one process; the worker count is unused
    lines += ["", f"Arguments: `{json.dumps(flags)}`", "", "![loss](loss.png)", ""]
    acc = summary.get("acceptance")
    lines += ["## Acceptance (our engine, greedy, held-out self-generated prompts)", ""]
    if acc:
        lines.append("```json")
        lines.append(json.dumps(acc, indent=2))
        lines.append("```")
    else:
        lines.append("Not measured by the training command; see `python -m train.evaluate`.")
    extra = state / "acceptance.json"
    if extra.is_file():
        lines += ["", "Further measurements (`python -m train.evaluate`):", "", "```json", extra.read_text().strip(), "```"]
    lines.append("")
    (out / "README.md").write_text("\n".join(lines))
