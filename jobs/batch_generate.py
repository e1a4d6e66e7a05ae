"""Batch generation over a JSONL file with Ray Data, resumable.

    ray job submit --working-dir . -- python -m jobs.batch_generate --input in.jsonl --output out.jsonl \
        [--model ...] [--speculative-algorithm ...] [--max-tokens ...] [--replicas N]

Input lines: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, with optional
sampling fields (max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos); any other
field (a dataset's "category", "source", ...) is copied unchanged to the output line. Output
lines: {"id", <other input fields>, "text", "token_ids", "finish_reason", "num_output_tokens",
"num_verify_steps"}, plus "error" where the engine refused or failed the request
(finish_reason "error").

Bad lines (not JSON, no id, duplicate id, bad field) go to <output>.errors.jsonl with their
line number and reason; the rest still run. A rerun skips ids already in the output and
retries the ones that ended with an error, and output is appended one whole line at a time (a
torn last line from a killed run is cut off on resume), so the file never holds a duplicate or
a partial line. A lock on <output>.lock refuses a second run on the same output meanwhile.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from spec.sampling import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "min_p",
                   "logprobs")
OUTPUT_FIELDS = ("id", "text", "token_ids", "finish_reason", "num_output_tokens", "num_verify_steps", "error")
INPUT_FIELDS = ("id", "prompt", "messages", *SAMPLING_FIELDS)


def id_key(value) -> str:
    """Ids may be numbers or strings; compare them by their JSON text."""
    return json.dumps(value, sort_keys=True)


def parse_line(raw: str, default_max_tokens: int) -> dict:
    """One input line -> {"id", "prompt" | "messages", "params"}; ValueError with the reason."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg}") from None
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    if "id" not in record or record["id"] is None or isinstance(record["id"], (dict, list)):
        raise ValueError("missing or invalid 'id' (a string or a number)")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise ValueError("exactly one of 'prompt' or 'messages' is required")
    if has_prompt and (not isinstance(record["prompt"], str) or not record["prompt"]):
        raise ValueError("'prompt' must be a non-empty string")
    if has_messages:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            raise ValueError("'messages' must be a non-empty list of {role, content} strings")
    extra = {k: v for k, v in record.items() if k not in INPUT_FIELDS}
    clash = sorted(set(extra) & set(OUTPUT_FIELDS))
    if clash:
        raise ValueError(f"field(s) {clash} would be overwritten by the output's own (rename them)")
    fields = {k: record[k] for k in SAMPLING_FIELDS if k in record}
    fields.setdefault("max_tokens", default_max_tokens)
    fields.setdefault("temperature", 0.0)
    params = SamplingParams(**fields)  # ValueError naming the bad field
    return {"id": record["id"], "prompt": record.get("prompt"), "messages": record.get("messages"),
            "params": asdict(params), "extra": extra}


def completed_ids(output: Path) -> set[str]:
    """Ids already answered; cuts a torn final line left by a killed run and drops the rows
    that ended with an error, so that they run again."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = data.rfind(b"\n") + 1
    lines = [line for line in data[:keep].decode().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines]
    good = [line for line, row in zip(lines, rows) if row.get("finish_reason") != "error"]
    if len(good) != len(lines):
        staged = output.with_name(output.name + ".tmp")
        staged.write_text("".join(line + "\n" for line in good))
        os.replace(staged, output)  # whole or not at all
    elif keep != len(data):
        with open(output, "r+b") as handle:
            handle.truncate(keep)
    return {id_key(json.loads(line)["id"]) for line in good}


def lock_output(output: Path) -> int:
    """Hold <output>.lock for this process's life (the kernel drops it when the process dies,
    so a killed run leaves no stale lock); refuse when another run holds it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = output.with_name(output.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"--output {output}: another run is writing it (it holds {lock})") from None
    return fd


def plan(input_path: Path, output: Path, default_max_tokens: int) -> tuple[list[dict], list[dict], int]:
    """Validate every line: (pending records, errors, number already done)."""
    done = completed_ids(output)
    pending, errors, seen = [], [], set()
    with open(input_path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = parse_line(raw, default_max_tokens)
                key = id_key(record["id"])
                if key in seen:
                    raise ValueError(f"duplicate id {record['id']!r}")
                seen.add(key)
            except ValueError as exc:
                errors.append({"line": number, "reason": str(exc), "text": raw.rstrip("\n")[:500]})
                continue
            if key not in done:
                pending.append(record)
    return pending, errors, len(done)


class GenerateBatch:
    """A Ray Data actor: builds one engine (graph) and generates for whole batches."""

    def __init__(self, engine_kwargs: dict):
        from graphs import EngineConfig, build_graph

        self.engine = build_graph(EngineConfig(**engine_kwargs))

    def __call__(self, batch: dict) -> dict:
        records = [json.loads(r) for r in batch["request"]]
        outs = self.engine.generate_each(
            [(r["messages"] or r["prompt"], SamplingParams(**r["params"])) for r in records], errors_as_outputs=True)
        return {"line": [json.dumps(output_row(r, o)) for r, o in zip(records, outs)]}


def output_row(record: dict, out) -> dict:
    """One output line: the id, the input's other fields unchanged, then the result."""
    row = {"id": record["id"], **record["extra"], **{k: getattr(out, k) for k in OUTPUT_FIELDS[1:]}}
    if row["error"] is None:
        del row["error"]
    if out.logprobs is not None:
        row["logprobs"] = out.logprobs
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--speculative-algorithm", default=None)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--eagle-topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="decode steps with more running requests than this skip drafting")
    parser.add_argument("--verify-budget", type=int, default=None,
                        help="most verify rows per decode step: larger batches keep fewer tree nodes each")
    parser.add_argument("--max-tokens", type=int, default=128, help="default for lines without max_tokens")
    parser.add_argument("--replicas", type=int, default=1, help="Ray Data actors, each building its own graph")
    parser.add_argument("--backend", default="local", choices=("local", "ray"),
                        help="graph inside each Ray Data actor: in-process (local) or its own actors (ray)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per map_batches call")
    parser.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--kv-slots", type=int, default=16384)
    args = parser.parse_args(argv)

    import ray
    from tqdm import tqdm

    from graphs import EngineConfig

    if not args.input.is_file():
        parser.error(f"--input {args.input}: no such file")
    errors_path = args.output.with_name(args.output.name + ".errors.jsonl")
    if args.input.resolve() in (args.output.resolve(), errors_path.resolve()):
        parser.error(f"--output {args.output}: must not be the input file (or its errors file)")
    engine_kwargs = dict(model=args.model, draft_model=args.draft_model, speculative_algorithm=args.speculative_algorithm,
                         num_steps=args.num_steps, eagle_topk=args.eagle_topk, num_draft_tokens=args.num_draft_tokens,
                         disable_by_batch_size=args.disable_by_batch_size, verify_budget=args.verify_budget,
                         kv_slots=args.kv_slots, max_running_requests=max(args.batch_size, 1), backend=args.backend)
    try:
        EngineConfig(**engine_kwargs)  # fail on a bad configuration before starting anything
    except ValueError as exc:
        parser.error(str(exc))
    try:
        lock_output(args.output)  # held until this process exits
    except ValueError as exc:
        parser.error(str(exc))
    pending, errors, done = plan(args.input, args.output, args.max_tokens)
    errors_path.write_text("".join(json.dumps(e) + "\n" for e in errors))
    print(f"{len(pending)} to generate, {done} already done, {len(errors)} bad line(s) -> {errors_path}", flush=True)
    if not pending:
        return 0

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "pending.jsonl"
        staged.write_text("".join(json.dumps({"request": json.dumps(r)}) + "\n" for r in pending))
        dataset = ray.data.read_json(str(staged)).map_batches(
            GenerateBatch, fn_constructor_kwargs={"engine_kwargs": engine_kwargs}, batch_size=args.batch_size,
            concurrency=args.replicas, num_cpus=args.num_cpus_per_replica,
        )
        start, tokens, steps, failed = time.perf_counter(), 0, 0, 0
        args.output.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(args.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            with tqdm(total=len(pending), desc="generate", unit="req", file=sys.stdout) as bar:
                for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
                    for line in batch["line"]:
                        os.write(fd, (str(line) + "\n").encode())  # one write per whole line
                        row = json.loads(line)
                        tokens += row["num_output_tokens"]
                        steps += row["num_verify_steps"]
                        failed += row["finish_reason"] == "error"
                    os.fsync(fd)
                    bar.update(len(batch["line"]))
        finally:
            os.close(fd)
    wall = time.perf_counter() - start
    print(json.dumps({"summary": {"requests": len(pending), "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
                                  "acceptance_length": round(tokens / max(steps, 1), 3), "wall_s": round(wall, 2),
                                  "errors": len(errors), "failed": failed, "skipped_done": done}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
