"""Small helpers, one topic per file: config checks, instantiation, run outputs."""
