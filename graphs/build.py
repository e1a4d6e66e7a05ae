"""`build_graph(config)`: the engine for a config, one process (backend "local") or Ray actors
and a compiled per-step graph (backend "ray")."""

from __future__ import annotations

from actors.cost_probe import probe_step_costs
from actors.scheduler import Scheduler
from actors.step import run_step
from actors.target_runner import TargetRunner
from graphs.assembly import eos_token_ids, make_drafter, resolve_sources, scheduler_config
from graphs.config import EngineConfig
from graphs.engine import Engine, LocalEngine
from models.build import load_tokenizer
from spec.batch import BatchMeta, DraftExtendInput, DraftInput


class LocalExecutor:
    """Runs the three phases of a step by direct calls in this process."""

    def __init__(self, target: TargetRunner, drafter):
        self.target, self.drafter = target, drafter

    def execute(self, meta: BatchMeta, draft_input: DraftInput) -> tuple[DraftExtendInput, DraftInput]:
        return run_step(self.target, self.drafter, meta, draft_input)


def build_local(config: EngineConfig) -> Engine:
    target, draft = resolve_sources(config)
    target_runner = TargetRunner(**config.target_kwargs(config.num_threads))
    drafter = make_drafter(config, **config.runner_kwargs(config.num_threads))
    tokenizer = load_tokenizer(target.folder)
    scheduler = Scheduler(scheduler_config(config, target, draft), LocalExecutor(target_runner, drafter),
                          tokenizer, eos_token_ids(target, tokenizer))
    if config.cost_probe:
        probe_step_costs(scheduler, [scheduler], scheduler.step)
    return LocalEngine(config, scheduler, tokenizer)


def build_graph(config: EngineConfig) -> Engine:
    """Build an engine for `config` (backend "local": one process; "ray": actors and a compiled graph)."""
    if config.backend == "local":
        return build_local(config)
    from graphs.ray_graph import RayEngine

    return RayEngine(config)
