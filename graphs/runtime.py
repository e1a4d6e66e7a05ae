"""GraphRuntime: the actors of one engine, the per-step executor, and recovery.

A plain class (it creates Ray actors but is not one) that the scheduler actor drives.
Recovery: when a step fails because an actor died, the compiled graph is torn down and the
dead actors are replaced in their placement-group bundles. A dead draft does not stop
decoding: steps go on target-only until the new draft is ready, then every running request
is re-prefilled through the full graph (its draft KV rebuilt by a draft extend) and
speculation resumes. A dead target is replaced, then the same resync refills its KV.
Requests that cannot be recovered end with finish_reason "error", never a hang.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.ray_actors import DraftActor, TargetActor, TargetDraftActor
from actors.scheduler import DataParallelScheduler, Request
from graphs.assembly import make_drafter
from graphs.config import OMP_ENV, EngineConfig
from graphs.executors import ActorCallExecutor, CompiledStepExecutor, RankActors, TargetOnlyExecutor

log = logging.getLogger(__name__)
RESTART_WINDOW_S = 600.0  # restarts older than this no longer count against the budget


class RestartBudget:
    """At most `limit` actor restarts within any `window_s`: healthy time pays it back."""

    def __init__(self, limit: int, window_s: float = RESTART_WINDOW_S):
        self.limit, self.window_s = limit, window_s
        self.times: deque[float] = deque()

    def spend(self, now: float) -> bool:
        """Count a restart at `now`; False once the budget is exceeded."""
        self.times.append(now)
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        return len(self.times) <= self.limit


def is_request_error(exc: BaseException) -> bool:
    """A step error its inputs caused (a runner raised), as opposed to a dead or stuck actor."""
    if isinstance(exc, RayTaskError):
        return exc.cause is not None and not isinstance(exc.cause, RayError)
    return not isinstance(exc, RayError)


def draft_cpus(config: EngineConfig) -> float:
    """CPUs of the drafter's own actor (placement "separate"): model-free drafters (NGRAM, NONE)
    take none, their actor only moves token ids."""
    return config.draft_num_cpus if config.algorithm.needs_draft_model else 0.0


def target_cpus(config: EngineConfig) -> float:
    """CPUs of a rank's target actor. A colocated drafter's CPUs join them whatever it drafts with:
    one process, one thread pool, so a model-free drafter's share goes to the target's forward
    (a rank takes target_num_cpus + draft_num_cpus for every algorithm; NONE on 1 of 2 CPUs decoded
    at one torch thread, docs/benchmarks.md "Session 33")."""
    return config.target_num_cpus + (config.draft_num_cpus if config.colocated_draft else 0.0)


def graph_bundles(config: EngineConfig) -> list[dict]:
    """Placement-group bundles of one graph: per rank, a target bundle then (draft placement
    "separate") a draft bundle. A colocated drafter's CPUs join the target's bundle."""
    bundles = []
    for _ in range(config.dp_size):
        target = {"CPU": target_cpus(config), **({"GPU": config.target_num_gpus} if config.target_num_gpus else {}),
                  **(config.target_resources or {})}
        bundles.append(target)
        if config.colocated_draft:
            continue
        draft = {"CPU": draft_cpus(config), **({"GPU": config.draft_num_gpus} if config.draft_num_gpus else {}),
                 **(config.draft_resources or {})}
        bundles.append({k: v for k, v in draft.items() if v} or {"CPU": 0.001})
    return bundles


class GraphRuntime:
    def __init__(self, config: EngineConfig, placement_group, bundle_offset: int, dp: DataParallelScheduler,
                 hidden_spec, topk_width: int):
        self.config = config
        self.pg = placement_group
        self.bundle_offset = bundle_offset
        self.dp = dp
        self.hidden_spec, self.topk_width = hidden_spec, topk_width
        self.per_rank = 1 if config.colocated_draft else 2  # placement-group bundles per rank
        self.ranks = [RankActors(self._new_target(r), None if config.colocated_draft else self._new_draft(r))
                      for r in range(config.dp_size)]
        ray.get([a.ready.remote() for a in self.actors()])
        self.executor = self._full_executor()
        self.pending_drafts: dict[int, ray.ObjectRef] = {}  # rank -> ready() of a restarting draft
        self.restarts = 0  # ever (stats)
        self.budget = RestartBudget(config.max_actor_restarts * len(self.actors()))
        self.broken: str | None = None  # why the engine cannot serve any more (its replica must go)
        dp.executor = self.executor

    # ---- actors ---------------------------------------------------------------------

    def _options(self, bundle: int, num_cpus: float, num_gpus: float) -> dict:
        policy = self.config.omp_wait_policy
        return dict(
            # glibc's malloc as the local engine has it: a fixed mmap threshold (1 MB, then 32 MB)
            # cost a batch-16 eagle3-tree step 20187 (4928) minor faults against 423 (steps run in a
            # thread, as in the actor; docs/benchmarks.md).
            num_cpus=num_cpus, num_gpus=num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            **({"runtime_env": {"env_vars": OMP_ENV[policy]}} if OMP_ENV[policy] else {}),
        )

    @staticmethod
    def _threads(num_cpus: float) -> int:
        return max(1, int(num_cpus))  # one torch thread per CPU granted

    def _runner_kwargs(self, num_cpus: float) -> dict:
        return self.config.runner_kwargs(num_threads=self._threads(num_cpus))

    def _new_target(self, rank: int):
        """The rank's target actor; with a colocated draft it hosts the drafter too, on both their CPUs."""
        c = self.config
        cpus = target_cpus(c)
        options = self._options(self.bundle_offset + self.per_rank * rank, cpus, c.target_num_gpus)
        kwargs = self._runner_kwargs(cpus)  # one process: both runners share its torch threads
        target_kwargs = c.target_kwargs(self._threads(cpus))
        if c.colocated_draft:
            return self._sleeping(TargetDraftActor.options(**options).remote(target_kwargs, make_drafter, c, **kwargs))
        return self._sleeping(TargetActor.options(**options).remote(**target_kwargs))

    def _new_draft(self, rank: int):
        c = self.config
        options = self._options(self.bundle_offset + self.per_rank * rank + 1, draft_cpus(c), c.draft_num_gpus)
        return self._sleeping(DraftActor.options(**options).remote(make_drafter, c, **self._runner_kwargs(draft_cpus(c))))

    def _sleeping(self, actor):
        """Set how the new actor's graph reads wait; actor calls run in order, so before any graph compiles."""
        actor.sleep_while_waiting.remote(self.config.graph_wait_sleep_us * 1e-6)
        return actor

    def _full_executor(self):
        if self.config.compiled_graph:
            return CompiledStepExecutor(self.ranks, self.config.step_timeout_s, self.config.graph_channel)
        return ActorCallExecutor(self.ranks)

    def actors(self) -> list:
        """Per rank the target actor, then its draft actor (placement "separate" only)."""
        return [a for rank in self.ranks for a in (rank.target, rank.draft) if a is not None]

    def actors_by_role(self) -> dict[str, list]:
        """{"targets": one per rank, "drafts": the separate draft actors (none where colocated)}."""
        return {"targets": [rank.target for rank in self.ranks],
                "drafts": [rank.draft for rank in self.ranks if rank.draft is not None]}

    def shutdown(self) -> None:
        self._teardown()
        for actor in self.actors():
            ray.kill(actor, no_restart=True)

    # ---- stepping and recovery -----------------------------------------------------

    def step(self, lock: AbstractContextManager = nullcontext()) -> list[Request]:
        """One step of every rank; scheduler state is only touched while holding `lock`."""
        with lock:
            self._maybe_resume_speculation()
        try:
            return self.dp.step(lock, is_request_error)
        except RayError as exc:
            log.warning("step failed (%s); recovering", type(exc).__name__)
            with lock:
                return self._recover(exc)

    def _teardown(self) -> None:
        try:
            self.executor.teardown()
        except Exception:  # noqa: BLE001 - a graph with a dead actor may fail to tear down cleanly
            log.debug("teardown of a broken graph raised", exc_info=True)

    def _alive(self, actor) -> bool:
        try:
            ray.get(actor.ready.remote(), timeout=30)
            return True
        except (RayError, TimeoutError):
            return False

    def _recover(self, exc: Exception) -> list[Request]:
        """Replace dead actors; the failed step committed nothing, so it is simply rerun."""
        self._teardown()
        self.restarts += 1
        if not self.budget.spend(time.monotonic()):
            self.broken = (f"engine could not recover: {len(self.budget.times)} actor restarts within "
                           f"{self.budget.window_s:.0f} s ({type(exc).__name__})")
            log.error("%s: %s", self.broken, exc)
            return self._fail_all(self.broken)
        self._release_step_slots()
        dead_target = False
        for r, rank in enumerate(self.ranks):
            if not self._alive(rank.target):
                ray.kill(rank.target, no_restart=True)
                rank.target = self._new_target(r)
                dead_target = True
            if rank.draft is not None and r not in self.pending_drafts and not self._alive(rank.draft):
                ray.kill(rank.draft, no_restart=True)
                rank.draft = self._new_draft(r)
                self.pending_drafts[r] = rank.draft.ready.remote()
        if dead_target:
            ray.get([rank.target.ready.remote() for rank in self.ranks])
        if self.pending_drafts:
            # Decode on without speculation until the new drafts have loaded.
            self.executor = TargetOnlyExecutor([rank.target for rank in self.ranks], self.hidden_spec, self.topk_width)
            self.dp.executor = self.executor
            if dead_target:
                try:
                    self.dp.resync()
                except RayError as again:
                    return self._recover(again)
            return []
        self._resume()
        return []

    def _resume(self) -> None:
        """Full graph again, and every running request re-prefilled into it."""
        self.executor = self._full_executor()
        self.dp.executor = self.executor
        try:
            self.dp.resync()
        except RayError as exc:
            self._recover(exc)

    def _maybe_resume_speculation(self) -> None:
        if not self.pending_drafts:
            return
        ready, _ = ray.wait(list(self.pending_drafts.values()), num_returns=len(self.pending_drafts), timeout=0)
        if len(ready) < len(self.pending_drafts):
            return
        try:
            ray.get(ready)
        except RayError as exc:  # the replacement died too: go through recovery again
            self.pending_drafts.clear()
            self._recover(exc)
            return
        self.pending_drafts.clear()
        self._resume()
        log.info("draft actors back; speculation resumed")

    def _release_step_slots(self) -> None:
        """A failed step allocated slots it never committed: give them back."""
        for rank in self.dp.ranks:
            rank.release_uncommitted()

    def _fail_all(self, message: str) -> list[Request]:
        return self.dp.fail_all(message)
