"""Draft training: EAGLE-3 self-distillation and standalone distillation, and the data they learn from.

May import: spec, models, actors, graphs (and the other top layer's packages: jobs, bench, serve)."""
