"""`python serve_app.py`: flags, a local Ray when none is given, Serve on the address asked."""

import argparse
import logging
import math
import os
import signal
import sys
import threading

import ray
from ray import serve

from graphs.config import EngineConfig
from graphs.runtime import graph_bundles
from models.registry import DEFAULT_MODEL
from serve.app import build_app
from serve.settings import (
    API_KEY_ENV, DEFAULT_EAGLE3_DRAFT, DEFAULT_SPECULATION, FALLBACK_SPECULATION, SERVE_DTYPE, SERVE_TORCH_COMPILE,
    bound_ray_gcs_env, split_args)

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="serve_app.py", description="OpenAI-compatible speculative-decoding server on Ray Serve.",
        epilog=f"Default: {DEFAULT_MODEL} with {DEFAULT_SPECULATION['speculative_algorithm']} speculation "
               f"(draft {DEFAULT_EAGLE3_DRAFT}); other models: {FALLBACK_SPECULATION['speculative_algorithm']}.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, folder or .gguf")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--speculative-algorithm", default=None, help="NONE, EAGLE, EAGLE3, STANDALONE or NGRAM")
    p.add_argument("--num-steps", type=int, default=None)
    p.add_argument("--eagle-topk", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--ngram-branch", type=int, default=None, help="prompt-lookup tokens forced into each draft tree")
    p.add_argument("--min-path-prob", type=float, default=None,
                   help="verify only draft tokens whose path probability reaches this "
                        "(0: full chains and trees; default model: 0.1)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="decode steps with more running requests than this skip drafting")
    p.add_argument("--verify-budget", type=int, default=None,
                   help="most verify rows per decode step: larger batches keep fewer tree nodes each "
                        "(default model: 16)")
    p.add_argument("--dp-size", type=int, default=None)
    p.add_argument("--draft-placement", choices=("colocated", "separate"), default=None,
                   help="drafter inside the target's actor or in its own (default: colocated, separate for a draft given GPUs or resources)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--kv-slots", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prompt tokens one prefill step carries; longer prompts prefill in chunks (512)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on a GPU, replay decode / verify and draft passes from CUDA graphs (on)")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=SERVE_TORCH_COMPILE,
                   help="on CPU, compile the target's decode / small verify passes with torch.compile "
                        "and attend through our C++ kernel (on; a longer start)")
    p.add_argument("--short-prefill-tokens", type=int, default=None,
                   help="prompts needing at most this many tokens beyond the prefix cache prefill in a step "
                        "of their own before the running decode (64; 0: off)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of earlier requests' shared prefixes (on by default)")
    p.add_argument("--reply-ids-tokens", type=int, default=None,
                   help="chat replies' generated ids kept (tokens) for the turn that sends a reply back: read as "
                        "generated, not re-tokenized, so the prefix cache matches through it (1048576; 0: off)")
    p.add_argument("--dtype", default=SERVE_DTYPE,
                   help="float32, bfloat16, float16 or auto (bf16 on GPUs and on CPUs with AMX/AVX512-BF16)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $SPECGRAPH_API_KEY; "
                        "needed to bind a non-loopback --host)")
    p.add_argument("--metrics-public", action="store_true", default=None, help="serve /metrics without the key")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of chat requests that give none (default: up to the context length)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests per replica before 503 (256)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound (1)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray started here")
    p.add_argument("--dashboard", action="store_true", help="start the Ray dashboard with the local Ray")
    return p.parse_args(argv)


def app_args_from_cli(ns: argparse.Namespace) -> dict:
    skip = {"host", "port", "num_cpus", "dashboard"}
    args = {k: v for k, v in vars(ns).items() if k not in skip and v is not None}
    if "api_key" not in args and os.environ.get(API_KEY_ENV):
        args["api_key_env"] = API_KEY_ENV  # the replicas read it: the key stays out of the app's args
    return args


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = app_args_from_cli(ns)
    try:  # bad flags fail here, before Ray starts
        application = build_app(args)
        engine_kwargs, settings = split_args(args)
        settings.check_exposure(ns.host)
    except ValueError as exc:
        print(f"serve_app.py: error: {exc}", file=sys.stderr)
        return 2
    config = EngineConfig(**engine_kwargs, backend="ray")

    stop = threading.Event()
    serving = threading.Event()

    def _on_signal(signum, frame):  # noqa: ARG001
        stop.set()
        if not serving.is_set():  # still starting: interrupt whatever is blocking
            raise KeyboardInterrupt

    started_ray = False
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"])
            else:
                needed = settings.replica_num_cpus + sum(b.get("CPU", 0) for b in graph_bundles(config)) + 0.2
                num_cpus = ns.num_cpus or max(os.cpu_count() or 1, math.ceil(needed))
                bound_ray_gcs_env()
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=ns.dashboard)
                started_ray = True
        serve.start(http_options={"host": ns.host, "port": ns.port})
        log.info("deploying %s (%s%s)...", config.model, config.algorithm.name,
                 f" with {config.draft_model}" if config.draft_model else "")
        serve.run(application, name="default", route_prefix="/")
        host = f"[{ns.host}]" if ":" in ns.host else ns.host
        log.info("serving %s at http://%s:%d/v1 (health: /health, metrics: /metrics); Ctrl-C to stop",
                 settings.served_model_name or config.model, host, ns.port)
        serving.set()
        while not stop.wait(1.0):
            pass
        log.info("stopping")
        return 0
    except KeyboardInterrupt:
        log.info("interrupted while starting; stopping")
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()


