"""Lightning + Hydra training for transformers on one 24 GB GPU.

Importing it registers the configs' OmegaConf resolvers, so ``hydra.compose`` works in tests and notebooks too.
"""

from .core.config.resolvers import register_resolvers

register_resolvers()
