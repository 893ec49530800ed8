"""What every task's LightningModule is built on: the shared ``base.HFModule``, the builder of
the Hugging Face model inside it, the facts it is handed (``inputs``), the levers, adapters and
precision policy, and the causal LM's loss and generation plumbing.  The task modules themselves
live in ``tasks/<name>/``; configs name each by its full path (``task.module``).
"""
