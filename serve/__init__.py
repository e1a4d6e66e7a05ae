"""The OpenAI-compatible server on Ray Serve: settings, the OpenAI protocol, the metrics hub, the
engine deployment, the HTTP ingress, the application and the CLI (`serve_app.py` is the entry).

May import: spec, models, actors, graphs (and the other top layer's packages: jobs, bench, train)."""
