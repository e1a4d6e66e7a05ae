"""EngineConfig: every engine default in one place, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.device import check_dtype_name, parse_dtype, pick_device
from models.registry import DEFAULT_MODEL
from spec.algorithm import SpecAlgorithm

BACKENDS = ("local", "ray")
DRAFT_PLACEMENTS = ("colocated", "separate")
GRAPH_CHANNELS = ("shm", "ray")
PREFILL_ORDERS = ("shortest", "fcfs")
# The runner actors' environment per `omp_wait_policy` (read by libgomp when torch loads).
# "brief": spin ~0.1 ms (3,000 pause loops) before sleeping: long enough to catch the next
# parallel region of a step, short enough that a partner the OS preempted costs little.
OMP_ENV = {"default": {}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
           "brief": {"GOMP_SPINCOUNT": "3000"}}
OMP_WAIT_POLICIES = tuple(OMP_ENV)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    speculative_algorithm: str | SpecAlgorithm | None = None
    draft_model: str | None = None
    num_steps: int = 3  # draft depth
    eagle_topk: int = 1  # 1: chain drafting; > 1: tree drafting
    num_draft_tokens: int = 4  # tree nodes verified per step, root included (chains use num_steps + 1)
    ngram_branch: int = 0  # tree drafting: up to this many prompt-lookup tokens forced into each tree
    # Draft-model chains and trees: verify only draft tokens whose path probability (the product
    # of the draft's probabilities from the root) reaches this, and stop drafting deeper once no
    # beam does. 0: every step drafts num_steps levels and verifies the full tree.
    min_path_prob: float = 0.0
    # Each decode step verifies the tree size (nodes per request, 1 = plain decoding) with the most
    # expected tokens per second, from step costs and per-request acceptance measured as it runs
    # (actors.cost_model). False: the full tree every step (within the caps below).
    adaptive_speculation: bool = True
    # Adaptive speculation starts from measured costs: at engine start, a few timed decode steps on
    # dummy requests (actors.cost_probe; about a second on a CPU). False: it measures on live traffic.
    cost_probe: bool = True
    # Caps a user may set on top. Decode steps with more running requests than this (per rank)
    # verify each root alone, as vLLM's disable_by_batch_size; None: no such cap.
    disable_by_batch_size: int | None = None
    # Most verify rows per decode step and rank: a batch of B verifies at most verify_budget // B
    # nodes of each tree, its likeliest (the root alone when that is below 2). None: no such cap.
    verify_budget: int | None = None
    dp_size: int = 1
    backend: str = "local"
    dtype: str = "float32"  # or "auto": bf16 where the hardware runs it natively (actors.device.auto_dtype)
    device: str = "auto"
    num_threads: int | None = None
    kv_slots: int = 16384  # token slots in the KV pool of each rank
    max_running_requests: int = 32
    # Tokens one step carries (vLLM's name): the running batch's verify rows, and in the same forward
    # chunks of waiting prompts, so a long prompt prefills over several steps and never stalls decoding.
    max_num_batched_tokens: int = 512
    # Waiting prompts whose uncomputed tokens (after the prefix cache) total at most this many run in
    # a prefill step of their own ahead of the running batch's decode, at most one such step between
    # two decode steps: their first token then waits for a short forward, not for a whole
    # speculative decode step (draft, tree verify, draft extend of every running request); where the
    # running batch decodes plain they ride in its step, which costs them a few rows. 0: off
    # (prompts always ride in the decode step).
    short_prefill_tokens: int = 64
    # Which prompts take each step's token budget first: "shortest", the fewest tokens left to compute
    # beyond the prefix cache (a short prompt's first token does not wait behind a long prompt's
    # prefill; a prompt overtaken for a few steps, `actors.scheduler.MAX_PASSED_OVER`, goes first, so
    # none starves), or "fcfs", arrival order.
    prefill_order: str = "shortest"
    # Keep finished requests' KV in a tree over token ids, reused by requests sharing a prefix.
    prefix_cache: bool = True
    # Chat: the generated ids of recent replies, up to this many tokens in all (graphs.chat_ids). A
    # later turn that sends a reply back unchanged, after the same prompt, reads the ids the model
    # wrote rather than the text's re-tokenization, so its prefix-cache match runs through the
    # answer. Independent of `prefix_cache`, so outputs stay identical with the cache off. 0: off.
    reply_ids_tokens: int = 1 << 20
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # Ray backend: resources per actor (GPU actors run on CUDA), placement and graph mode.
    target_num_cpus: float = 1.0
    # The drafter's CPUs: its own actor's (placement "separate"; model-free drafters, NGRAM and NONE,
    # take none there), or, colocated, added to the target actor's whatever it drafts with.
    draft_num_cpus: float = 1.0
    target_num_gpus: float = 0.0
    draft_num_gpus: float = 0.0
    target_resources: dict | None = None  # custom resources, e.g. {"target_node": 1}
    draft_resources: dict | None = None
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    # Where the drafter runs: "colocated" inside the target's actor (one Ray hop per step, hidden
    # states never serialized; its CPUs join the target's), "separate" in its own actor (a draft
    # that needs its own device or node). None: separate when draft_num_gpus / draft_resources ask
    # for the draft's own place, else colocated, the faster one measured (STANDALONE included: its
    # draft and target forwards run one after the other, so sharing one thread pool gives each all
    # of the rank's cores; docs/benchmarks.md "The Ray actor graph" and "Session 33").
    draft_placement: str | None = None
    compiled_graph: bool = True  # False: plain actor calls each step (for comparison)
    # On CUDA, replay the target's decode / verify pass and the draft's propose and extend passes
    # from CUDA graphs captured per batch-size bucket (actors.cuda_graphs); prefill and mixed steps,
    # and any pass off CUDA, run eagerly. False: every pass eager.
    cuda_graphs: bool = True
    # On CPU, run the target's passes of at most 64 token rows (decode of up to 64 requests, verify
    # trees of a few) through its decoder compiled by torch.compile (models.compiled): the linears
    # stay as they are, inductor fuses the small ops between them; and the target's and draft's
    # attention through our C++ kernel (models.cpu_kernels). Both build when the runners load
    # (about a minute on 2 cores the first time, less from the caches after). Off here (the offline
    # API and tests start in seconds); `make serve` turns it on (serve.settings).
    torch_compile: bool = False
    # Ray 2.60's compiled-graph reads spin while they wait (ray#55128), stealing the cores the
    # runners compute on; the graph's processes poll instead, sleeping up to this long between
    # tries (the most a wait adds to a hop). 0: Ray's spinning read (actors.channel_wait). Reads of our
    # own channel (`graph_channel="shm"`) always sleep on its doorbell.
    graph_wait_sleep_us: float = 500.0
    # What carries the compiled graph's values between processes of one node: "shm", our own
    # shared-memory slot woken by a doorbell (actors.shm_channel: 0.5-1.6 ms less coordination a step
    # than Ray's channel, docs/benchmarks.md session 45), or "ray", Ray's shared-memory channel. Edges to
    # another node always take Ray's.
    graph_channel: str = "shm"
    # How the runner actors' OpenMP threads wait for each other between parallel regions (OMP_ENV,
    # set before torch loads): "default" (libgomp spins ~ms, then sleeps), "active" (spins),
    # "passive" (sleeps at once) or "brief" (spins ~0.1 ms). A thread spinning for a partner the OS
    # has preempted wastes its core, and a 2-core server shares its cores with the scheduler, Serve
    # and the client (docs/benchmarks.md). The local backend runs in the caller's process, as it is.
    omp_wait_policy: str = "default"
    step_timeout_s: float = 300.0  # a step slower than this counts as a failed actor
    # Actor restarts allowed per actor of the graph within 10 minutes; beyond them the engine is
    # broken (its Serve replica reports unhealthy and is replaced).
    max_actor_restarts: int = 3

    def __post_init__(self) -> None:
        self.algorithm = SpecAlgorithm.from_name(self.speculative_algorithm)
        for name in ("num_steps", "eagle_topk", "dp_size", "kv_slots", "max_running_requests",
                     "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_actor_restarts", "short_prefill_tokens", "reply_ids_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")
        check_dtype_name(self.dtype)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.algorithm.needs_draft_model and not self.draft_model:
            raise ValueError(f"draft_model: {self.algorithm.name} needs a draft model (registry name, folder or .gguf)")
        if not self.algorithm.needs_draft_model and self.draft_model:
            raise ValueError(f"draft_model: not used by speculative_algorithm {self.algorithm.name}")
        if self.algorithm is SpecAlgorithm.NGRAM and self.eagle_topk != 1:
            raise ValueError("eagle_topk: NGRAM drafts chains only (eagle_topk=1)")
        if self.eagle_topk > 1:
            most = 1 + self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
            if not 2 <= self.num_draft_tokens <= most:
                raise ValueError(
                    f"num_draft_tokens must be in [2, {most}] for num_steps={self.num_steps}, "
                    f"eagle_topk={self.eagle_topk}, got {self.num_draft_tokens}"
                )
        if not isinstance(self.ngram_branch, int) or isinstance(self.ngram_branch, bool) or self.ngram_branch < 0:
            raise ValueError(f"ngram_branch must be a non-negative integer, got {self.ngram_branch!r}")
        if self.ngram_branch and (not self.algorithm.needs_draft_model or self.eagle_topk == 1):
            raise ValueError("ngram_branch: a prompt-lookup branch joins a draft model's tree (eagle_topk > 1)")
        if self.ngram_branch >= self.num_draft_tokens:
            raise ValueError(f"ngram_branch must be below num_draft_tokens ({self.num_draft_tokens}), "
                             f"got {self.ngram_branch}")
        if isinstance(self.min_path_prob, bool) or not isinstance(self.min_path_prob, (int, float)) \
                or not 0 <= self.min_path_prob < 1:
            raise ValueError(f"min_path_prob must be a number in [0, 1), got {self.min_path_prob!r}")
        if self.min_path_prob and not self.algorithm.needs_draft_model:
            raise ValueError(f"min_path_prob: {self.algorithm.name} has no draft probabilities (a draft model's do)")
        for name in ("disable_by_batch_size", "verify_budget"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.algorithm is SpecAlgorithm.NONE:
                raise ValueError(f"{name}: there is no speculation to limit (speculative_algorithm NONE)")
            if not _positive_int(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("adaptive_speculation", "cost_probe", "cuda_graphs", "torch_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got {self.placement_strategy!r}")
        for name in ("graph_wait_sleep_us", "target_num_cpus", "draft_num_cpus", "target_num_gpus", "draft_num_gpus"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative number, got {getattr(self, name)!r}")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ValueError(f"omp_wait_policy must be one of {OMP_WAIT_POLICIES}, got {self.omp_wait_policy!r}")
        if self.graph_channel not in GRAPH_CHANNELS:
            raise ValueError(f"graph_channel must be one of {GRAPH_CHANNELS}, got {self.graph_channel!r}")
        if self.draft_placement is not None and self.draft_placement not in DRAFT_PLACEMENTS:
            raise ValueError(f"draft_placement must be one of {DRAFT_PLACEMENTS} or None, got {self.draft_placement!r}")
        if self.draft_placement == "colocated" and (self.draft_num_gpus or self.draft_resources):
            raise ValueError("draft_placement: 'colocated' runs the draft in the target's actor, on the target's "
                             "resources; draft_num_gpus / draft_resources need draft_placement='separate'")
        if self.dp_size > 1 and self.backend != "ray":
            raise ValueError("dp_size: data parallelism needs backend='ray'")

    @property
    def colocated_draft(self) -> bool:
        """Whether the Ray graph hosts the drafter inside the target's actor (draft_placement resolved)."""
        if self.draft_placement is not None:
            return self.draft_placement == "colocated"
        return not (self.draft_num_gpus or self.draft_resources)

    def runner_kwargs(self, num_threads: int | None) -> dict:
        """What every runner is built with besides its model: KV pool size, dtype, device, threads."""
        return dict(num_slots=self.kv_slots, dtype=self.torch_dtype, device=self.device, num_threads=num_threads,
                    cuda_graphs=self.cuda_graphs, torch_compile=self.torch_compile)

    def target_kwargs(self, num_threads: int | None) -> dict:
        """What the target runner is built with: its model and drafter's, and runner_kwargs."""
        return dict(model=self.model, algorithm=self.algorithm, draft_model=self.draft_model,
                    **self.runner_kwargs(num_threads))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype every runner of the graph uses ("auto" resolved once, here, so that target
        and draft actors agree): GPU actors when the Ray graph asks for GPUs, else this process."""
        gpu = self.backend == "ray" and self.target_num_gpus > 0
        return parse_dtype(self.dtype, torch.device("cuda") if gpu else pick_device(self.device))

    @property
    def tree_size(self) -> int:
        """Nodes verified per request and step, the root (last verified token) included."""
        if self.algorithm is SpecAlgorithm.NONE:
            return 1
        if self.eagle_topk == 1:
            return self.num_steps + 1
        return self.num_draft_tokens

    @property
    def tree_depth(self) -> int:
        """Draft tokens on a full tree's deepest path: the draft's levels (`num_steps`), or a longer
        prompt-lookup branch (`ngram_branch`, a chain from the root within the tree's nodes)."""
        if self.algorithm is SpecAlgorithm.NONE:
            return 0
        return min(self.tree_size - 1, max(self.num_steps, self.ngram_branch))

    @property
    def scratch_size(self) -> int:
        """Draft KV slots written while proposing: one per expanded beam, plus the root for STANDALONE."""
        if not self.algorithm.needs_draft_model:
            return 0
        beams = (self.num_steps - 1) * self.eagle_topk
        return beams + (1 if self.algorithm is SpecAlgorithm.STANDALONE else 0)

    @property
    def topk_width(self) -> int:
        """Columns of DraftInput.topk_*: EAGLE drafts have already scored the next token."""
        return self.eagle_topk if self.algorithm.is_eagle else 0
