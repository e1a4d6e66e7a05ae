"""Plain runner classes (TargetRunner, DraftRunner, Scheduler) and their thin Ray actor wrappers.

May import: spec, models."""
