"""Compression: pruning during training, quantization-aware training, post-training quantization (docs/compression.md)."""

# Model families whose transformer blocks are built from transformers' ``Conv1D`` (a Linear with its
# weight transposed), not ``nn.Linear``: pruning, QAT and the torchao variants of ``quantize`` act
# on ``nn.Linear`` layers, so they refuse these families rather than leave them untouched.
CONV1D_MODEL_TYPES = ("gpt2",)


def conv1d_refusal(lever: str, model_type: str, fix: str) -> str:
    """The one message for a lever that acts on ``nn.Linear`` and a :data:`CONV1D_MODEL_TYPES` model."""
    return (
        f"{lever} acts on nn.Linear layers, and model_type={model_type!r} builds its transformer blocks from transformers' "
        f"Conv1D; fix: {fix}, or a Llama- or BERT-family model"
    )
