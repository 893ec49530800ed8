"""LightningModules (one file per task, on the shared ``base.HFModule``), and the builder that
makes the Hugging Face model inside them.

Configs name each module class by its full path (``task.module``), so a project generated for
one task holds only that task's files.
"""
