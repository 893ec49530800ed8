"""Checkpoints: atomic writes (in the background), what a checkpoint may hold, loading one back."""
