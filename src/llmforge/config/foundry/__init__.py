"""``llmforge convert foundry``: LLM Foundry (Composer) training YAMLs as llmforge YAMLs.

:func:`~llmforge.config.foundry.convert.convert` maps each section (model and tokenizer in
:mod:`.model`, loaders in :mod:`.data`, the loop in :mod:`.training`, monitors and checkpoints in
:mod:`.monitors`) and reports every key it could not map; docs/migrating_from_composer.md.
"""

from llmforge.config.foundry.context import Clock, Conversion, parse_time
from llmforge.config.foundry.convert import convert, read_foundry, report, write_converted

__all__ = ["Clock", "Conversion", "convert", "parse_time", "read_foundry", "report", "write_converted"]
