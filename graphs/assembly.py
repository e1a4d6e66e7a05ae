"""What an EngineConfig builds, shared by both backends: the checked target/draft pair, the
drafter, the scheduler's config and the EOS ids (the local engine calls these in-process; the
Ray graph inside its actors)."""

from __future__ import annotations

from actors.draft_runner import DraftRunner, NgramDrafter, NoDrafter
from actors.scheduler import SchedulerConfig
from graphs.config import EngineConfig
from models.build import ModelSource, check_draft_checkpoint, check_draft_kind, check_target
from spec.algorithm import SpecAlgorithm
from spec.shapes import cfg_get, get_draft_recurrent_hidden_state_spec, validate_spec_pair


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
        return NgramDrafter(config.num_steps)
    return DraftRunner(config.algorithm, config.draft_model, config.model, config.num_steps,
                       config.eagle_topk, config.tree_size, ngram_branch=config.ngram_branch,
                       min_path_prob=config.min_path_prob, **runner_kwargs)


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
        max_num_batched_tokens=config.max_num_batched_tokens,
        short_prefill_tokens=config.short_prefill_tokens,
        prefill_order=config.prefill_order,
        prefix_cache=config.prefix_cache,
        max_model_len=min(context, config.max_model_len or context),
        needs_history=config.algorithm is SpecAlgorithm.NGRAM or config.ngram_branch > 0,
        vocab_size=int(cfg_get(target.config, "vocab_size", 0)) or None,
        draft_depth=config.tree_depth,
        draft_levels=0 if config.algorithm is SpecAlgorithm.NONE else config.num_steps,
        adaptive=config.adaptive_speculation,
        verify_budget=config.verify_budget,
        disable_by_batch_size=config.disable_by_batch_size,
    )


def eos_token_ids(target: ModelSource, tokenizer) -> set[int]:
    ids = cfg_get(target.config, "eos_token_id", [])
    ids = set(ids if isinstance(ids, list) else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
