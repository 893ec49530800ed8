"""Run identity: what a run is made of (config, model, tokenizer and data fingerprints)."""
