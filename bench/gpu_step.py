"""GPU step time, the device check of CUDA graphs (issue 34): ms per decode step with CUDA graphs
on and off, random weights of real models' shapes, one script for a lent GPU.

    python -m bench.gpu_step [--out bench/results/gpu_step.json]   # on the GPU: ~5 minutes on an H200
    python -m bench.gpu_step --smoke --out /tmp/gpu_step.json      # tiny shapes on CPU: that it runs

1. SmolLM2-135M's shapes (bf16): whole engine steps (scheduler, target verify, draft propose and
   extend, as the server runs them) for NONE (plain decoding) and the EAGLE-3 tree (topk 4, 8
   nodes, 3 levels, a random head: the tree is full every step) at 1, 8, 32 and 256 running
   requests, graphs on and off. Adaptive speculation is off, so every EAGLE-3 step verifies the
   whole tree.
2. Llama-3.1-8B's shapes (bf16, random weights built on the GPU, no checkpoint): the target's plain
   decode pass (forward, logits, argmax) at batch 1 and 32, graphs on and off, beside the time to
   read its bf16 weights once at the H200's 4.8 TB/s.

Steps are timed after the prompts are prefilled and `--warmup` steps (which capture the graphs);
figures are medians of `--steps` steps. Prints the JSON and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Shapes (vocab, hidden, layers, heads, kv heads, intermediate).
SMOLLM2_135M = dict(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536)
LLAMA_8B = dict(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336)
TINY = dict(vocab_size=64, hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128)
HBM_BYTES_PER_S = 4.8e12  # H200
TREE = dict(speculative_algorithm="EAGLE3", eagle_topk=4, num_draft_tokens=8, num_steps=3)
PROMPT_LEN = 64


def _progress(message: str) -> None:
    print(f"[bench.gpu_step] {message}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def write_models(root: Path, shape: dict) -> tuple[Path, Path]:
    """A random Llama of `shape` and a random EAGLE-3 head for it, saved as checkpoints."""
    from bench.random_models import make_eagle3, make_llama

    target = make_llama(root / "target", vocab_size=shape["vocab_size"], hidden=shape["hidden"],
                        layers=shape["layers"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                        intermediate=shape["intermediate"], max_pos=2048, std=0.02, tie=True)
    head = make_eagle3(root / "eagle3", target, hidden=shape["hidden"], heads=shape["heads"],
                       kv_heads=shape["kv_heads"])
    return target, head


def engine_step_ms(target: Path, draft: Path | None, batch: int, graphs: bool, args) -> float:
    """Median ms of a whole engine decode step with `batch` running requests."""
    from graphs import EngineConfig, build_graph
    from spec.sampling import SamplingParams

    steps = args.warmup + args.steps
    tree = TREE if draft is not None else {}
    rows = 8 if draft is not None else 1
    config = EngineConfig(
        model=str(target), draft_model=None if draft is None else str(draft), **tree,
        kv_slots=batch * (PROMPT_LEN + (steps + 4) * 2 * rows) + 1024, max_running_requests=batch,
        max_num_batched_tokens=max(512, batch * rows), cost_probe=False, adaptive_speculation=False,
        prefix_cache=False, cuda_graphs=graphs, dtype=args.dtype, device=args.device,
    )
    engine = build_graph(config)
    try:
        scheduler = engine.scheduler
        vocab = int(scheduler.executor.target.model.shape.vocab_size)
        params = SamplingParams(max_tokens=(steps + 4) * rows, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            scheduler.add_request([(7 * i + j) % (vocab - 2) for j in range(PROMPT_LEN)], params)
        prefill_steps = -(-batch * PROMPT_LEN // config.max_num_batched_tokens) + 1
        for _ in range(prefill_steps + args.warmup):
            scheduler.step()
        times = []
        for _ in range(args.steps):
            _sync(args.device)
            start = time.perf_counter()
            scheduler.step()
            _sync(args.device)
            times.append(time.perf_counter() - start)
    finally:
        engine.shutdown()
    return round(1e3 * statistics.median(times), 3)


@torch.inference_mode()
def plain_decode_ms(shape: dict, batch: int, graphs: bool, args, context: int = 512) -> float:
    """Median ms of the target's plain decode pass (forward, logits, argmax) of a random model of
    `shape` built in place on the device (an 8B checkpoint would take minutes to write)."""
    import transformers

    from actors.cuda_graphs import StepGraphs, pool_slots
    from actors.pass_rows import PassRows
    from models.llama import LlamaForCausalLM
    from models.packed import pack_linears

    dtype = getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16")
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"], max_position_embeddings=8192, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    for p in model.parameters():
        p.normal_(0, 0.02)
    pack_linears(model, dtype, args.device)
    slots = batch * (context + 1)
    kv = model.make_kv_pool(pool_slots(slots), dtype, args.device)
    forward = lambda tokens, _hidden, attn: model(tokens, attn, kv)  # noqa: E731
    runner = StepGraphs(forward, args.device, dump_slot=slots, capture=True) if graphs else None
    prefix = torch.arange(batch * context).view(batch, context)
    rows = PassRows(tokens=torch.ones(batch, dtype=torch.long), positions=torch.full((batch,), context),
                    prefix=prefix, prefix_lens=torch.full((batch,), context),
                    slots=torch.arange(batch * context, batch * (context + 1)), new_lens=torch.ones(batch, dtype=torch.long))
    times = []
    for i in range(args.warmup + args.steps):
        _sync(args.device)
        start = time.perf_counter()
        out = runner.run(rows) if runner is not None else None
        hidden = out[0] if out is not None else forward(rows.tokens.to(args.device), None, rows.metadata(args.device))[0]
        model.logits(hidden).argmax(-1).cpu()
        _sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, kv
    if args.device == "cuda":
        torch.cuda.empty_cache()
    args.weight_bytes = weight_bytes
    return round(1e3 * statistics.median(times), 3)


def _get(table: dict, *keys: str):
    for key in keys:
        table = table.get(key) if isinstance(table, dict) else None
    return table


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/gpu_step.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, few steps: that the script runs")
    parser.add_argument("--batches", default="1,8,32,256")
    parser.add_argument("--big-batches", default="1,32")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    if args.smoke:
        args.device, args.dtype, args.warmup, args.steps = "cpu", "float32", 1, 2
        small, big, batches, big_batches = TINY, TINY, [3], [1, 2]
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (--smoke runs tiny shapes on CPU)")
        args.device = "cuda"
        small, big, batches, big_batches = SMOLLM2_135M, LLAMA_8B, ints(args.batches), ints(args.big_batches)
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": args.dtype,
                    "smoke": args.smoke, "prompt_len": PROMPT_LEN, "warmup_steps": args.warmup, "steps": args.steps,
                    "tree": TREE, "small_model": small, "step_ms": {}, "big_model": big, "big_plain_decode_ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        target, head = write_models(Path(tmp), small)
        for name, draft in (("NONE", None), ("EAGLE3_tree", head)):
            for batch in batches:
                for graphs in (False, True):
                    ms = engine_step_ms(target, draft, batch, graphs, args)
                    result["step_ms"].setdefault(name, {}).setdefault(str(batch), {})["graphs_on" if graphs else "graphs_off"] = ms
                    _progress(f"{name} batch {batch} graphs {'on' if graphs else 'off'}: {ms} ms/step")
    for batch in big_batches:
        for graphs in (False, True):
            ms = plain_decode_ms(big, batch, graphs, args)
            result["big_plain_decode_ms"].setdefault(str(batch), {})["graphs_on" if graphs else "graphs_off"] = ms
            _progress(f"8B-shaped batch {batch} graphs {'on' if graphs else 'off'}: {ms} ms/step")
    result["big_weight_bytes"] = args.weight_bytes
    result["big_weight_read_ms_at_4.8TBps"] = round(1e3 * args.weight_bytes / HBM_BYTES_PER_S, 3)
    steps, big_ms = result["step_ms"], result["big_plain_decode_ms"]
    on = lambda table, *keys: _get(table, *keys, "graphs_on")  # noqa: E731
    result["done_when"] = {
        "smollm2_32_graphs_on_ms (<= 5)": on(steps, "NONE", "32"),
        "smollm2_256_graphs_on_ms (<= 10)": on(steps, "NONE", "256"),
        "8b_batch1_vs_weight_read (<= 1.5)": _ratio(on(big_ms, "1"), result["big_weight_read_ms_at_4.8TBps"]),
        "eagle3_tree_vs_plain_batch1 (<= 1.3)": _ratio(on(steps, "EAGLE3_tree", "1"), on(steps, "NONE", "1")),
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    out = json.dumps(result, indent=2)
    print(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(out + "\n")
    return result


if __name__ == "__main__":
    main()
    os._exit(0)  # no lingering CUDA / thread teardown: the device time is short
