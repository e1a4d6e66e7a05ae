"""Draft training: EAGLE-3 self-distillation and standalone distillation."""
