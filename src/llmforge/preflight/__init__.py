"""The resolved run: a validated config resolved once (world size, strategy, batch plan, mesh,
threads, resume point) into one frozen object that the CLI, ``llmforge launch``, the dry run,
the Trainer and the plugins share (:mod:`llmforge.preflight.resolve`). Nothing here imports
torch, so config errors are reported before it is imported.
"""
