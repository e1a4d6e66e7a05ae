"""Weight average of drafts (a "model soup"): heads fine-tuned from one parent on different data
stay in one basin, and their average often keeps most of what each learned. The shipped EAGLE-3
head is the average of its predecessor and that head's fine-tune on target-written prompts
(its card has the numbers).

    python -m train.average drafts/smollm2-135m-instruct-eagle3 /tmp/eagle3-new --out DIR [--weights 0.5,0.5] [--name N]

Every source must have the same config (architecture, draft vocabulary, aux layers) and the same
tensors; index tensors (d2t, t2d) must be equal. Floating tensors are averaged in fp32 and saved in
the first source's dtype. DIR gets the weights, config.json, the first source's tokenizer files
(a standalone draft carries them) and a model card naming the sources and weights, each source's
card below it with its loss curve.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from train import checkpoints


def parse_weights(text: str, count: int) -> list[float]:
    """--weights "a,b,..": one positive number per source, normalised to sum to 1; empty = equal."""
    if not text:
        return [1.0 / count] * count
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--weights: {text!r} is not a comma list of numbers") from None
    if len(weights) != count or any(not w > 0 for w in weights):
        raise ValueError(f"--weights: need {count} positive numbers (one per source), got {text!r}")
    return [w / sum(weights) for w in weights]


def average(sources: list[Path], weights: list[float]) -> tuple[dict, dict[str, torch.Tensor], torch.dtype]:
    """(config, averaged fp32 state, first source's dtype); ValueError naming the first config
    field or tensor where a source differs from the first."""
    configs, states = zip(*(checkpoints.read_draft(s, "sources") for s in sources))
    dtype = getattr(torch, configs[0].get("torch_dtype") or "float32")
    base = {k: v for k, v in configs[0].items() if k != "torch_dtype"}
    for source, config, state in zip(sources[1:], configs[1:], states[1:]):
        for field in sorted((set(base) | set(config)) - {"torch_dtype"}):
            if config.get(field) != base.get(field):
                raise ValueError(f"{source}: config field {field} is {config.get(field)!r}, "
                                 f"{sources[0]} has {base.get(field)!r}")
        if set(state) != set(states[0]):
            raise ValueError(f"{source}: tensors {sorted(set(state) ^ set(states[0]))} are not in every source")
        for name, tensor in state.items():
            first = states[0][name]
            if tensor.shape != first.shape or (not first.is_floating_point() and not torch.equal(tensor, first)):
                raise ValueError(f"{source}: tensor {name} differs from {sources[0]}'s "
                                 "(the sources need one architecture and one draft vocabulary)")
    merged = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            merged[name] = sum(w * s[name] for w, s in zip(weights, states))
        else:
            merged[name] = first
    return base, merged, dtype


def write_card(out: Path, name: str, sources: list[Path], weights: list[float]) -> None:
    """The average's card, titled `name`: sources and weights, then each source's card with its
    headings two levels down and every image it shows copied beside it as source<i>-<file> (its
    loss.png as source<i>-loss.png; a source that is itself an average keeps its sources' curves)."""
    lines = [f"# {name}", "", f"Weight average of {len(sources)} drafts with one architecture and draft vocabulary "
             "(`python -m train.average`):", "", "| source | weight |", "|---|---|"]
    lines += [f"| `{s}` | {w:.4g} |" for s, w in zip(sources, weights)]
    lines += ["", "Measure it with `python -m train.evaluate`; the sources' cards follow.", ""]
    for i, source in enumerate(sources, 1):
        lines += [f"## Source {i}: `{source}`", "", source_card(source, out, f"source{i}-"), ""]
    (out / "README.md").write_text("\n".join(lines))


def source_card(source: Path, out: Path, prefix: str) -> str:
    """`source`'s card with its headings two levels down (to sit under a "## " heading of the card
    in `out`) and every image it shows copied into `out` as prefix + file name."""
    card = (source / "README.md").read_text() if (source / "README.md").is_file() else "(no card)"
    for image in sorted(set(re.findall(r"\]\(([\w.-]+\.png)\)", card))):
        if (source / image).is_file():
            shutil.copy(source / image, out / f"{prefix}{image}")
            card = card.replace(f"]({image})", f"]({prefix}{image})")
    return re.sub(r"^(#+) ", r"\1## ", card, flags=re.MULTILINE).strip()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="draft folders (config.json + model.safetensors)")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", default="", help="comma list, one per source (normalised); default equal")
    p.add_argument("--name", default="", help="the card's title (default: the --out folder's name)")
    args = p.parse_args(argv)
    sources = [Path(s).expanduser() for s in args.sources]
    out = Path(args.out).expanduser()
    if len(sources) < 2:
        raise ValueError("sources: give at least two draft folders to average")
    if any(source.resolve() == out.resolve() for source in sources):
        raise ValueError(f"--out {out} is one of the sources; write the average to a new folder")
    weights = parse_weights(args.weights, len(sources))
    config, state, dtype = average(sources, weights)
    checkpoints.write_draft(out, state, config, dtype)
    for name in checkpoints.TOKENIZER_FILES:
        if (sources[0] / name).is_file():
            shutil.copy(sources[0] / name, out / name)
    write_card(out, args.name or out.name, sources, weights)
    print(json.dumps({"out": str(out), "sources": [str(s) for s in sources], "weights": weights}))


if __name__ == "__main__":
    main()
