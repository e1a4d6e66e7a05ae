"""Target runner speed: plain decode tokens/s at several batch sizes, the cost of verifying n
draft tokens relative to one, and transformers' `generate` on the same weights for reference.

    python -m bench.runner [--model smollm2-135m-instruct] [--dtype float32[,bfloat16]]
                           [--out bench/results/runner.json] [--plot]

Decode goes through `TargetRunner.forward_step` with a one-node tree per request (the NONE
algorithm's plain decoding), after a prefill of `--prompt-len` tokens per request, with KV
slots from `SlotAllocator`. Prints JSON (and writes it to --out); --plot draws a PNG next to it.
Timings are medians per step where noise matters (this box is shared); tokens/s use totals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from actors.slots import SlotAllocator
from actors.target_runner import TargetRunner
from models.registry import DEFAULT_MODEL
from spec.batch import BatchMeta, VerifyInput
from spec.tree import ancestor_mask, chain_parents

NUM_SLOTS = 4096


def _progress(message: str) -> None:
    print(f"[bench.runner] {message}", file=sys.stderr, flush=True)


def _meta(seq_lens: list[int], kv_slots: torch.Tensor, verify_slots: torch.Tensor | None = None,
          prefill: tuple[torch.Tensor, torch.Tensor] | None = None) -> BatchMeta:
    """Greedy requests: a prefill step when `prefill` = (tokens (B, P), slots (B, P)), else decode."""
    b = len(seq_lens)
    long = lambda *s: torch.zeros((b, *s), dtype=torch.long)  # noqa: E731
    tokens, slots = prefill if prefill is not None else (long(0), long(0))
    return BatchMeta(
        seq_lens=torch.tensor(seq_lens, dtype=torch.long), kv_slots=kv_slots,
        prefill_lens=torch.full((b,), tokens.shape[1], dtype=torch.long), prefill_tokens=tokens,
        prefill_slots=slots, next_token=torch.full((b,), -1, dtype=torch.long), scratch_slots=long(0),
        verify_slots=verify_slots if verify_slots is not None else long(1), temperature=torch.zeros(b),
        top_p=torch.ones(b), top_k=long(), seeds=long(), history=long(0),
    )


def _chain(tokens: torch.Tensor, seq_lens: torch.Tensor) -> VerifyInput:
    """(B, n) tokens as a chain after each request's context (n = 1: plain decode)."""
    batch, n = tokens.shape
    parents = chain_parents(batch, n)
    return VerifyInput(tokens, parents, seq_lens.unsqueeze(1) + torch.arange(n), ancestor_mask(parents))


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


class _Requests:
    """`batch` requests prefilled in one step, then decoded or verified at will."""

    def __init__(self, runner: TargetRunner, alloc: SlotAllocator, batch: int, prompt_len: int):
        self.runner, self.alloc = runner, alloc
        prompts = _prompts(batch, prompt_len, runner.model.shape.vocab_size)
        slots = alloc.alloc(batch * prompt_len).view(batch, prompt_len)
        start = time.perf_counter()
        ext = runner.forward_step(_meta([0] * batch, torch.zeros(batch, 0, dtype=torch.long),
                                        prefill=(prompts, slots)), VerifyInput.create_idle(1))
        self.prefill_s = time.perf_counter() - start
        self.kv_slots = slots
        self.last = ext.next_tokens[ext.offsets + ext.extend_lens - 1]  # (B,) the verified ids

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.full((self.kv_slots.shape[0],), self.kv_slots.shape[1], dtype=torch.long)

    def decode_step(self) -> float:
        """One plain decode step for every request; commits the token; returns seconds."""
        batch = self.kv_slots.shape[0]
        vslots = self.alloc.alloc(batch).view(batch, 1)
        meta = _meta(self.seq_lens.tolist(), self.kv_slots, verify_slots=vslots)
        verify = _chain(self.last.view(batch, 1), self.seq_lens)
        start = time.perf_counter()
        ext = self.runner.forward_step(meta, verify)
        elapsed = time.perf_counter() - start
        assert ext.accept_lens.tolist() == [0] * batch
        self.kv_slots = torch.cat([self.kv_slots, ext.slots.view(batch, 1)], dim=1)
        self.last = ext.next_tokens
        return elapsed

    def verify_costs(self, ns: list[int], warmup: int, steps: int) -> dict[int, float]:
        """Median seconds of verifying an n-token chain, for each n (same context and slots every
        time; the n values take turns so that load from other processes hits them alike)."""
        batch, vocab = self.kv_slots.shape[0], self.runner.model.shape.vocab_size
        cases = {}
        for n in ns:
            vslots = self.alloc.alloc(batch * n).view(batch, n)
            tokens = torch.cat([self.last.view(batch, 1), _prompts(batch, n - 1, vocab, seed=1)], dim=1)
            cases[n] = (vslots, _meta(self.seq_lens.tolist(), self.kv_slots, verify_slots=vslots),
                        _chain(tokens, self.seq_lens))
        times: dict[int, list[float]] = {n: [] for n in ns}
        for i in range(warmup + steps):
            for n, (_, meta, verify) in cases.items():
                start = time.perf_counter()
                self.runner.forward_step(meta, verify)
                if i >= warmup:
                    times[n].append(time.perf_counter() - start)
        for vslots, _, _ in cases.values():
            self.alloc.free(vslots.reshape(-1))
        return {n: statistics.median(t) for n, t in times.items()}

    def release(self) -> None:
        self.alloc.free(self.kv_slots.reshape(-1))


def bench_runner(model: str, dtype: str, batches: list[int], verify_ns: list[int], prompt_len: int,
                 warmup: int, steps: int, threads: int | None) -> dict:
    runner = TargetRunner(model, num_slots=NUM_SLOTS, dtype=dtype, device="cpu", num_threads=threads)
    alloc = SlotAllocator(NUM_SLOTS)
    out: dict = {"decode_tokens_per_s": {}, "decode_step_ms_median": {}, "prefill_s": {}}
    for batch in batches:
        reqs = _Requests(runner, alloc, batch, prompt_len)
        for _ in range(warmup):
            reqs.decode_step()
        times = [reqs.decode_step() for _ in range(steps)]
        out["decode_tokens_per_s"][str(batch)] = round(batch * steps / sum(times), 2)
        out["decode_step_ms_median"][str(batch)] = round(1e3 * statistics.median(times), 2)
        out["prefill_s"][str(batch)] = round(reqs.prefill_s, 3)
        _progress(f"runner {dtype} batch {batch}: {out['decode_tokens_per_s'][str(batch)]} tokens/s")
        if batch == 1:
            cost = reqs.verify_costs(verify_ns, warmup, steps)
            base = cost[verify_ns[0]]
            out["verify_ms_median_batch1"] = {str(n): round(1e3 * c, 2) for n, c in cost.items()}
            out["verify_cost_vs_n1_batch1"] = {str(n): round(c / base, 3) for n, c in cost.items()}
        reqs.release()
    assert alloc.num_free == NUM_SLOTS, "slots leaked"
    return out


@torch.inference_mode()
def bench_transformers(folder: Path, dtype: torch.dtype, batches: list[int], prompt_len: int, steps: int) -> dict:
    """Greedy `generate` decode tokens/s: (t(1 + steps new tokens) - t(1 new token)) removes prefill."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    vocab = model.config.vocab_size

    def generate(prompts: torch.Tensor, new: int) -> float:
        start = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=model.config.eos_token_id)
        assert out.shape[1] == prompts.shape[1] + new
        return time.perf_counter() - start

    out: dict = {"decode_tokens_per_s": {}}
    for batch in batches:
        prompts = _prompts(batch, prompt_len, vocab)
        generate(prompts, 3)  # warmup
        short = min(generate(prompts, 1) for _ in range(2))
        long = generate(prompts, 1 + steps)
        out["decode_tokens_per_s"][str(batch)] = round(batch * steps / max(long - short, 1e-9), 2)
        _progress(f"transformers generate batch {batch}: {out['decode_tokens_per_s'][str(batch)]} tokens/s")
    return out


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed in this environment, no PNG written ({path}); "
              "install it with `pip install matplotlib`", file=sys.stderr)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series = {f"runner {d}": r["decode_tokens_per_s"] for d, r in result["runner"].items()}
    hf = result["transformers_generate"]
    series[f"transformers generate {hf['dtype']}"] = hf["decode_tokens_per_s"]
    for name, values in series.items():
        xs = sorted(int(b) for b in values)
        left.plot(xs, [values[str(b)] for b in xs], marker="o", label=name)
    left.set(xscale="log", xlabel="batch size", ylabel="decode tokens/s", title=result["model"])
    left.legend()
    for d, r in result["runner"].items():
        costs = r["verify_cost_vs_n1_batch1"]
        xs = sorted(int(n) for n in costs)
        right.plot(xs, [costs[str(n)] for n in xs], marker="o", label=f"runner {d}")
    right.set(xlabel="tokens verified in one pass (batch 1)", ylabel="time relative to 1 token",
              title="verify cost")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", help="runner dtype(s), comma-separated (e.g. float32,bfloat16)")
    parser.add_argument("--out", default="bench/results/runner.json")
    parser.add_argument("--plot", action="store_true", help="write a PNG next to --out (needs matplotlib)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--hf-batches", default="1,8")
    parser.add_argument("--verify-n", default="1,4,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]

    started = time.perf_counter()
    # Other processes on a small box distort every figure here: record the load around the run.
    result: dict = {"model": args.model, "device": "cpu", "cpu_count": os.cpu_count(),
                    "load_avg_1m_start": round(os.getloadavg()[0], 2), "prompt_len": args.prompt_len,
                    "warmup_steps": args.warmup, "decode_steps": args.steps, "runner": {}}
    for dtype in dtypes:
        result["runner"][dtype] = bench_runner(args.model, dtype, ints(args.batches), ints(args.verify_n),
                                               args.prompt_len, args.warmup, args.steps, args.threads)
    result["threads"] = torch.get_num_threads()
    from actors.device import parse_dtype
    from models.loader import resolve_model

    hf = bench_transformers(resolve_model(args.model), parse_dtype(dtypes[0]), ints(args.hf_batches),
                            args.prompt_len, args.steps)
    result["transformers_generate"] = dict(hf, dtype=dtypes[0])
    ours = result["runner"][dtypes[0]]["decode_tokens_per_s"]
    result["runner_vs_transformers"] = {
        b: round(ours[b] / v, 2) for b, v in hf["decode_tokens_per_s"].items() if b in ours
    }
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.plot and plot(result, out.with_suffix(".png")):
        result["plot"] = str(out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
