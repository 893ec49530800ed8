"""The memory planner: peak GPU memory of a training step, predicted on the CPU without a GPU."""
