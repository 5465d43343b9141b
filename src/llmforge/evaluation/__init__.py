"""Evaluation beyond the training loss: EleutherAI's lm-evaluation-harness
(:mod:`llmforge.evaluation.harness`), used by ``llmforge eval`` and the ``eval_harness``
callback."""
