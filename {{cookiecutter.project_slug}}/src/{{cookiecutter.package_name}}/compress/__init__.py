"""Compression: pruning during training, quantization-aware training, post-training quantization (docs/compression.md)."""
