"""Check a target and a draft before serving them together, from their configs and the tensor
names and shapes in their checkpoints' headers; no weight is read.

    python -m graphs.check_pair TARGET DRAFT [--algorithm EAGLE3]

TARGET and DRAFT are what --model and --draft-model take (registry names, Hugging Face folders,
.gguf files). The algorithm defaults to what the draft is (its `architectures`, else its tensor
names). Prints the shapes the pair agrees on and exits 0, or prints the mismatch, naming the
field, and exits 2. It runs the checks the server runs at startup (graphs.engine.resolve_sources).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from graphs.config import EngineConfig
from graphs.assembly import resolve_sources
from models.build import ModelSource, check_target, draft_kind
from spec.algorithm import SpecAlgorithm
from spec.shapes import agreed_shapes, cfg_get

MISMATCH_EXIT_CODE = 2


def check_pair(target: str, draft: str, algorithm: str | SpecAlgorithm | None = None) -> dict[str, Any]:
    """The shapes a target/draft pair agrees on; a ValueError naming the field where they do not."""
    if algorithm is None:
        source = ModelSource.resolve(draft)
        algorithm = draft_kind(source.config, source.tensor_names())
    config = EngineConfig(model=target, speculative_algorithm=algorithm, draft_model=draft)
    target_source, draft_source = resolve_sources(config)
    shape = check_target(target_source)
    return {
        "target_model_type": cfg_get(target_source.config, "model_type"),
        "target_heads": f"{shape.num_heads} q / {shape.num_kv_heads} kv x {shape.head_dim}",
        "draft_architectures": cfg_get(draft_source.config, "architectures", []),
        **agreed_shapes(config.algorithm, target_source.config, draft_source.config),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="target model: registry name, folder or .gguf")
    parser.add_argument("draft", help="draft model: registry name, folder or .gguf")
    parser.add_argument("--algorithm", default=None,
                        help="EAGLE3, EAGLE or STANDALONE (default: what the draft checkpoint is)")
    args = parser.parse_args(argv)
    try:
        shapes = check_pair(args.target, args.draft, args.algorithm)
    except ValueError as exc:
        print(f"mismatch: {exc}")
        return MISMATCH_EXIT_CODE
    print(f"ok: {args.target} and {args.draft} agree")
    for key, value in shapes.items():
        print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
