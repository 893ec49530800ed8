"""What every task's LightningModule is built on (``base.HFModule``, model builder, inputs, levers, adapters, precision);
the task modules live in ``tasks/<name>/``."""
