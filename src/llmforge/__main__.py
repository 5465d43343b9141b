"""``python -m llmforge`` (also ``torchrun -m llmforge train CONFIG``)."""

import sys

from llmforge.cli import main

sys.exit(main())
