"""LightningDataModules on Hugging Face ``datasets`` (one file per task, shared loading and tokenisation)."""
