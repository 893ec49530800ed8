"""The template's plumbing, below the tasks: ``cruft update`` brings its fixes, so edit your own
code in ``tasks/<name>/`` and ``configs/`` instead.  Nothing here imports ``tasks``: the entry points
resolve the task once and hand the task object down (see ``core/task.py``)."""
