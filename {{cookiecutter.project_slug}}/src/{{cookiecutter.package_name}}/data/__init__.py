"""LightningDataModules on Hugging Face ``datasets``."""

from .classification import ClassificationDataModule

__all__ = ["ClassificationDataModule"]
