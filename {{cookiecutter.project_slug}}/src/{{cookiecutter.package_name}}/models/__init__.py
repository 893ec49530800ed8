"""LightningModules (one module per task), and the builder that makes the HF model inside them.

Configs name the classes by full path (``models.classification.SequenceClassificationModule``,
``models.causal_lm.CausalLMModule``), so a project generated for one task holds only its files.
"""
