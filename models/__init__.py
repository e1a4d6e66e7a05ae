"""Model code: Llama-family target with a token-slot KV pool, EAGLE / EAGLE-3 heads, loading and registry.

May import: spec."""
