"""Server settings: what `serve_app.py` flags and Serve-config `args` mean, split into EngineConfig
fields and ServeSettings, coerced and validated where they are built, and the default speculation."""

import functools
import ipaddress
import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Optional


from graphs.config import EngineConfig
from models.registry import DEFAULT_MODEL, REGISTRY
from spec.algorithm import SpecAlgorithm


log = logging.getLogger(__name__)

DEFAULT_EAGLE3_DRAFT = "smollm2-135m-instruct-eagle3"
# What the server speculates with unless told otherwise (docs/benchmarks.md, bench/results/spec_bench.json):
# the default model with its shipped EAGLE-3 head drafting a tree that also carries a prompt-lookup
# branch (the fastest config on Spec-Bench, bf16, batch 1), any other model with prompt lookup
# (NGRAM), which needs no draft. Full trees stop paying as the batch grows (above 2-4 running
# requests on a 2-core CPU, bench/results/concurrency.json); each step's tree size is chosen from
# measured step costs and acceptance (EngineConfig.adaptive_speculation, actors.cost_model), so the
# same default fits any host; verify_budget / disable_by_batch_size remain as caps. Tree nodes the draft
# finds less than 10% likely are left out: on held-out prompts, on a 2-core CPU, that went from
# 1.14x to 1.20x over none at 4 requests a batch and from 1.62x to 1.63x at one (bench/results/min_path_prob_heldout*.json); where
# verify rows cost little (GPUs, bf16 on AVX512-BF16/AMX CPUs) 0 may be faster. Keys the user gave
# win over these.
DEFAULT_SPECULATION = {"speculative_algorithm": "EAGLE3", "draft_model": DEFAULT_EAGLE3_DRAFT, "num_steps": 3,
                       "eagle_topk": 4, "num_draft_tokens": 8, "ngram_branch": 5, "min_path_prob": 0.1}
FALLBACK_SPECULATION = {"speculative_algorithm": "NGRAM"}
# The server's dtype unless one is asked for (the CLI, the deploy config and bench.serve_load's servers):
# bf16 on GPUs and on CPUs with AMX / AVX512-BF16, fp32 elsewhere.
SERVE_DTYPE = "auto"
# The server compiles its target's small passes on CPU and attends through our C++ kernel
# (EngineConfig.torch_compile), as vLLM's CPU engine compiles its model and runs its own attention
# kernels: a longer start, a faster step (docs/benchmarks.md, "Session 47", "Session 48").
SERVE_TORCH_COMPILE = True
ENGINE_DEPLOYMENT = "SpecEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
METRICS_PUSH_S = 1.0
API_KEY_ENV = "SPECGRAPH_API_KEY"  # the CLI's default key, and the deploy configs' api_key_env
# Ray's GCS keeps the events of every task (~3.4 KB each, for the dashboard's task list and the
# state API) up to 100,000 tasks, and past that the ids of the tasks it dropped, up to 1,000,000
# per job. A server makes several Serve calls per request and more every second (metrics, long
# polls), so the GCS's RSS grew 11% in a 5-minute soak; 30,000 actor calls took it from 47 to
# 149 MB, and with both bounds at 1000 it stays at ~58 MB from the first 5000 on (docs/benchmarks.md).
# The latest 1000 tasks are enough to debug with. The GCS reads these when Ray starts: the
# environment of `ray start` (deploy/) or of the first ray.init.
RAY_GCS_ENV = {"RAY_task_events_max_num_task_in_gcs": "1000",
               "RAY_task_events_max_dropped_task_attempts_tracked_per_job_in_gcs": "1000"}


@dataclass
class ServeSettings:
    """Serving options that are not engine options (those live in EngineConfig)."""

    served_model_name: Optional[str] = None  # default: the config's model name
    # When a key is set, /v1/* (and /metrics, unless metrics_public) needs "Authorization: Bearer
    # <key>". api_key_env names an environment variable of the replicas holding it (deploy configs:
    # never a key in the file); api_key is the key itself (the CLI, tests).
    api_key: Optional[str] = None
    api_key_env: Optional[str] = None
    metrics_public: bool = False  # True: /metrics answers without the key
    max_queue: int = 256  # per replica: 503 once this many requests wait for a batch slot (0: refuse all)
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: Optional[float] = None  # default: 0.75 * batch size
    max_ongoing_requests: Optional[int] = None  # default: batch size + max_queue + 16
    ingress_replicas: int = 1
    replica_num_cpus: float = 0.1  # the engine replica's own bundle (the graph's bundles follow)
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    # max_tokens of chat requests that set none (OpenAI: up to the context). KV is allocated as
    # requests grow, so this caps answer length only.
    default_max_tokens: Optional[int] = None
    health_stall_s: float = 900.0  # an engine silent this long is unhealthy (Serve replaces the replica)

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_replicas", "ingress_replicas", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if self.api_key_env is not None and (not isinstance(self.api_key_env, str) or not self.api_key_env):
            raise ValueError(f"api_key_env must name an environment variable, got {self.api_key_env!r}")

    def resolved_api_key(self) -> Optional[str]:
        """The key this process enforces: api_key, else the variable api_key_env names (unset: none)."""
        if self.api_key:
            return self.api_key
        return os.environ.get(self.api_key_env) or None if self.api_key_env else None

    def check_exposure(self, host: str) -> None:
        """Refuse to serve on a non-loopback address without an API key."""
        if is_loopback(host) or self.resolved_api_key():
            return
        where = (f"environment variable {self.api_key_env} (api_key_env) is not set" if self.api_key_env
                 else "set api_key_env to the name of an environment variable holding the key")
        raise ValueError(f"api_key: serving on {host!r} (not a loopback address) needs an API key; {where}")


def bound_ray_gcs_env() -> None:
    """RAY_GCS_ENV into this process's environment (a value already set wins), before it starts Ray."""
    for name, value in RAY_GCS_ENV.items():
        os.environ.setdefault(name, value)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig)}
_SETTINGS_FIELDS = {f.name: f for f in fields(ServeSettings)}


def _coerce(name: str, annotation: str, value: Any) -> Any:
    """Args from `serve run ... key=value` or YAML may arrive as strings: convert by field type."""
    if value is None or not isinstance(value, str):
        return value
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or str(annotation)
    kind = kind.replace("typing.", "")
    if name == "speculative_algorithm":  # "NONE" is an algorithm here, not a missing value
        return value
    if value.lower() in ("none", "null", "") and ("None" in kind or "Optional" in kind):
        return None
    if kind.startswith("bool"):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    try:
        if "int" in kind and "float" not in kind:
            return int(value)
        if "float" in kind:
            return float(value)
        if kind.startswith("dict"):
            return json.loads(value)
    except (ValueError, json.JSONDecodeError):
        raise ValueError(f"{name}: cannot read {value!r} as {kind}") from None
    return value


@functools.lru_cache(maxsize=None)
def default_draft_available() -> bool:
    """The trained EAGLE-3 draft of the default model is registered and its files are there."""
    if DEFAULT_EAGLE3_DRAFT not in REGISTRY:
        return False
    from models.loader import resolve_model

    try:
        resolve_model(DEFAULT_EAGLE3_DRAFT)
        return True
    except Exception as exc:  # noqa: BLE001 - registered but not trained/shipped yet
        log.warning("%s is registered but not usable (%s): using NGRAM", DEFAULT_EAGLE3_DRAFT, exc)
        return False


def apply_spec_defaults(engine: dict) -> dict:
    """Default speculation when none is asked for: DEFAULT_SPECULATION on the default model
    (FALLBACK_SPECULATION on others, or when the shipped head is missing). Asking for EAGLE3
    without a draft on the default model picks the shipped SmolLM2 EAGLE-3 head."""
    engine = dict(engine)
    model = engine.get("model") or DEFAULT_MODEL
    engine["model"] = model
    algorithm, draft = engine.get("speculative_algorithm"), engine.get("draft_model")
    if algorithm is None and draft is None:
        default = DEFAULT_SPECULATION if model == DEFAULT_MODEL and default_draft_available() else FALLBACK_SPECULATION
        given = {k for k, v in engine.items() if v is not None}
        engine.update({k: v for k, v in default.items() if engine.get(k) is None})
        if "ngram_branch" not in given and (engine.get("eagle_topk") == 1
                                            or engine.get("ngram_branch", 0) >= engine.get("num_draft_tokens", 0)):
            engine.pop("ngram_branch", None)  # the default branch fits the default tree, not one the user shaped
        if "min_path_prob" not in given and engine.get("eagle_topk") == 1:
            engine.pop("min_path_prob", None)  # chosen for trees; chains lost speed with it (docs/benchmarks.md)
    elif (draft is None and model == DEFAULT_MODEL and SpecAlgorithm.from_name(algorithm) is SpecAlgorithm.EAGLE3
          and default_draft_available()):
        engine["draft_model"] = DEFAULT_EAGLE3_DRAFT
    return engine


def split_args(args: dict | None) -> tuple[dict, ServeSettings]:
    """`build_app` args -> (EngineConfig kwargs with defaults applied, ServeSettings)."""
    engine, settings = {}, {}
    for key, value in (args or {}).items():
        key = key.replace("-", "_")
        if key in _SETTINGS_FIELDS:
            settings[key] = _coerce(key, _SETTINGS_FIELDS[key].type, value)
        elif key in _ENGINE_FIELDS and key != "backend":
            engine[key] = _coerce(key, _ENGINE_FIELDS[key].type, value)
        elif key == "backend":
            if value != "ray":
                raise ValueError("backend: the server always runs the ray backend")
        else:
            known = sorted([*_ENGINE_FIELDS, *_SETTINGS_FIELDS])
            raise ValueError(f"unknown argument {key!r}; known: {', '.join(known)}")
    engine = apply_spec_defaults(engine)
    EngineConfig(**engine, backend="ray")  # validate now, not in a replica
    return engine, ServeSettings(**settings)


