"""Scale without a GPU: the simulation of one training step at the real world size
(:mod:`llmforge.planning.simulate`), the GPU kinds table (:mod:`llmforge.planning.gpus`) and
the layout planner behind ``llmforge plan`` (:mod:`llmforge.planning.planner`)."""
