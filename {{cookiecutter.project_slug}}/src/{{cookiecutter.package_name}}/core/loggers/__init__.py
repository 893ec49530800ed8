"""Loggers: the per-launch CSV log, W&B and TensorBoard with masked secrets, reading CSV logs back."""
