"""A run's life: the entry-point wrapper, its folder and outputs, secrets, sweeps, DDP launches."""
