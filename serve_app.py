"""OpenAI-compatible HTTP server on Ray Serve, over one speculative-decoding graph per replica.

    python serve_app.py [--host 127.0.0.1] [--port 8000] [--model NAME] [--draft-model NAME]
        [--speculative-algorithm NONE|EAGLE|EAGLE3|STANDALONE|NGRAM] [--num-steps N]
        [--eagle-topk K] [--num-draft-tokens N] [--dp-size N] [--api-key KEY] [--max-model-len N]
    serve run serve_app:app                     # the same defaults, through the Serve CLI
    serve run deploy/serve_config.yaml          # build_app(args) with the config's args

The server lives in the `serve/` package; this file is its entry point (the import path deploy
configs name, `serve_app:build_app`, and `serve_app:app`). Two deployments:
  * `OpenAIIngress` (FastAPI, `serve/ingress.py`): auth, body limits, request validation and OpenAI response
    shapes, SSE streaming; `/metrics` renders every replica's counters.
  * `SpecEngine` (`serve/engine.py`): each replica owns one actor graph (RayEngine: scheduler, target and draft
    actors), reserved with the replica through `placement_group_bundles` (bundle 0 is the
    replica's own, the graph's bundles follow). It autoscales on ongoing requests.

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
GET /metrics. Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.
"""

from serve.app import build_app
from serve.cli import main

__all__ = ["app", "build_app", "main"]

app = build_app({})

if __name__ == "__main__":
    raise SystemExit(main())
