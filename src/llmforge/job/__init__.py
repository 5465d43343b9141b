"""The job side of a run: what runs where the training runs.

``torchrun`` (torch's launcher that keeps llmforge's exit codes), ``supervisor`` (a local job:
runs torchrun, records, restarts), ``nproc`` (``llmforge train --nproc N``), ``tracker`` (the
training process reports to the run records) and ``records`` (the SQLite run records,
``$LLMFORGE_HOME/runs.db``, written by both sides). The launcher side (backends, clusters,
``llmforge launch``) is :mod:`llmforge.runs`; it imports this package, never the reverse.
"""
