"""The offline engine: tokenization, chat templates, and driving the scheduler."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from actors.draft_runner import BatchLimits, DraftRunner, NgramDrafter, NoDrafter
from actors.request import RequestOutput
from actors.scheduler import Scheduler, SchedulerConfig
from actors.target_runner import TargetRunner
from graphs.config import EngineConfig
from models.build import ModelSource, check_draft_checkpoint, check_draft_kind, check_target, load_tokenizer
from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, DraftInput
from spec.sampling import SamplingParams
from spec.shapes import cfg_get, get_draft_recurrent_hidden_state_spec, validate_spec_pair

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


class LocalExecutor:
    """Runs the three phases of a step by direct calls in this process."""

    def __init__(self, target: TargetRunner, drafter):
        self.target, self.drafter = target, drafter

    def execute(self, meta: BatchMeta, draft_input: DraftInput) -> tuple[DraftExtendInput, DraftInput]:
        verify = self.drafter.propose(meta, draft_input)
        ext = self.target.forward_step(meta, verify)
        return ext, self.drafter.extend(meta, ext)


def resolve_sources(config: EngineConfig) -> tuple[ModelSource, ModelSource | None]:
    """Resolve and validate the target/draft pair from configs (and the checkpoints' tensor names
    and shapes, read from file headers) alone, before weights load."""
    target = ModelSource.resolve(config.model)
    draft = ModelSource.resolve(config.draft_model) if config.draft_model else None
    check_target(target)
    if draft is not None:
        check_draft_kind(config.algorithm, draft)
    validate_spec_pair(config.algorithm, target.config, None if draft is None else draft.config)
    if draft is not None:
        check_draft_checkpoint(config.algorithm, draft, target)
    return target, draft


def make_drafter(config: EngineConfig, **runner_kwargs):
    if config.algorithm is SpecAlgorithm.NONE:
        return NoDrafter()
    if config.algorithm is SpecAlgorithm.NGRAM:
        drafter = NgramDrafter(config.num_steps)
    else:
        drafter = DraftRunner(config.algorithm, config.draft_model, config.model, config.num_steps,
                              config.eagle_topk, config.tree_size, ngram_branch=config.ngram_branch,
                              min_path_prob=config.min_path_prob, **runner_kwargs)
    if config.disable_by_batch_size is not None or config.verify_budget is not None:
        return BatchLimits(drafter, config.disable_by_batch_size, config.verify_budget)
    return drafter


def scheduler_config(config: EngineConfig, target: ModelSource, draft: ModelSource | None) -> SchedulerConfig:
    context = int(cfg_get(target.config, "max_position_embeddings", 4096))
    return SchedulerConfig(
        algorithm=config.algorithm,
        tree_size=config.tree_size,
        scratch_size=config.scratch_size,
        topk_width=config.topk_width,
        hidden_spec=get_draft_recurrent_hidden_state_spec(
            config.algorithm, target.config, None if draft is None else draft.config, config.torch_dtype),
        kv_slots=config.kv_slots,
        max_running_requests=config.max_running_requests,
        max_prefill_tokens=config.max_prefill_tokens,
        max_model_len=min(context, config.max_model_len or context),
        needs_history=config.algorithm is SpecAlgorithm.NGRAM or config.ngram_branch > 0,
    )


def eos_token_ids(target: ModelSource, tokenizer) -> set[int]:
    ids = cfg_get(target.config, "eos_token_id", [])
    ids = set(ids if isinstance(ids, list) else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Engine:
    """The offline API shared by both backends: prompts, chat templates, generate/chat/stream."""

    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    # ---- prompts --------------------------------------------------------------------

    def encode(self, prompt: Prompt | Messages) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if prompt and isinstance(prompt[0], dict):
            return self.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]

    def encode_chat(self, messages: Messages) -> list[int]:
        if not messages:
            raise ValueError("messages: must contain at least one message")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation -----------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        return self.generate_each([(p, params) for p in prompts])

    def chat(self, conversations: Sequence[Messages], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        return self._generate_ids([(self.encode_chat(c), params) for c in conversations])

    def generate_each(self, requests: Sequence[tuple[Prompt | Messages, SamplingParams]]) -> list[RequestOutput]:
        """Many requests, each with its own sampling parameters, batched together."""
        return self._generate_ids([(self.encode(p), params) for p, params in requests])

    def stream(self, prompt: Prompt | Messages, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as steps complete (other requests progress meanwhile)."""
        return self._stream_ids(self.encode(prompt), params or SamplingParams())

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        raise NotImplementedError

    def _stream_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release the engine's resources (runners, actors); the engine is unusable afterwards."""


class LocalEngine(Engine):
    """Everything in this process: the caller's thread drives the scheduler."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, tokenizer):
        super().__init__(config, tokenizer)
        self.scheduler = scheduler

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        requests = [self.scheduler.find(self.scheduler.add_request(ids, params)) for ids, params in requests]
        while any(r.finish_reason is None for r in requests):
            self.scheduler.step()
        return [r.output() for r in requests]

    def _stream_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        request = self.scheduler.find(self.scheduler.add_request(prompt_ids, params))
        try:
            while request.finish_reason is None:
                self.scheduler.step()
                delta = request.take_delta()
                if delta:
                    yield delta
            tail = request.take_delta()
            if tail:
                yield tail
        finally:
            if request.finish_reason is None:
                self.scheduler.abort(request.rid)


def build_local(config: EngineConfig) -> Engine:
    target, draft = resolve_sources(config)
    runner_kwargs = config.runner_kwargs(config.num_threads)
    target_runner = TargetRunner(config.model, config.algorithm, config.draft_model, **runner_kwargs)
    drafter = make_drafter(config, **runner_kwargs)
    tokenizer = load_tokenizer(target.folder)
    scheduler = Scheduler(scheduler_config(config, target, draft), LocalExecutor(target_runner, drafter),
                          tokenizer, eos_token_ids(target, tokenizer))
    return LocalEngine(config, scheduler, tokenizer)


def build_graph(config: EngineConfig) -> Engine:
    """Build an engine for `config` (backend "local": one process; "ray": actors and a compiled graph)."""
    if config.backend == "local":
        return build_local(config)
    from graphs.ray_graph import RayEngine

    return RayEngine(config)
