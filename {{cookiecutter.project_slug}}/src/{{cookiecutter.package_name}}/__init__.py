"""Lightning + Hydra training for transformers on one 24 GB GPU.

Importing the package registers the OmegaConf resolvers the configs use (``${accumulate:...}``),
so ``hydra.compose`` works in tests and notebooks as it does in the entry points.
"""

from .core.config.groups import register_resolvers

register_resolvers()
