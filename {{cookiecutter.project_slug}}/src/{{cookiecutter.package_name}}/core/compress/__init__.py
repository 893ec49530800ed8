"""Compression: pruning during training, quantization-aware training, post-training quantization (docs/compression.md)."""

# Families whose blocks use transformers' ``Conv1D`` (a transposed Linear): pruning, QAT and the torchao ``quantize``
# variants act on ``nn.Linear``, so they refuse these rather than leave them untouched.
CONV1D_MODEL_TYPES = ("gpt2",)


def conv1d_refusal(lever: str, model_type: str, fix: str) -> str:
    """The one message for a lever that acts on ``nn.Linear`` and a :data:`CONV1D_MODEL_TYPES` model."""
    return (
        f"{lever} acts on nn.Linear layers, and model_type={model_type!r} builds its transformer blocks from transformers' "
        f"Conv1D; fix: {fix}, or a Llama- or BERT-family model"
    )
