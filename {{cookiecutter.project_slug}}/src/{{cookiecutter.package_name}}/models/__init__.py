"""LightningModules, and the builder that makes the Hugging Face model inside them."""

from .classification import SequenceClassificationModule

__all__ = ["SequenceClassificationModule"]
