"""Hydra configs, shipped inside the package so installed console scripts find them."""
