"""Lightning's private attributes that llmforge uses all live in parallel/lightning_private.py;
this fails, naming the attribute, when a Lightning release changes one of them."""

import lightning as L
import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from llmforge.parallel.lightning_private import check_lightning_private


def test_the_installed_lightning_has_every_private_attribute_llmforge_uses():
    check_lightning_private()  # raises RuntimeError naming what is gone


def test_a_renamed_attribute_is_named_with_the_lightning_version(monkeypatch):
    monkeypatch.delattr(ModelParallelStrategy, "_setup_distributed")
    with pytest.raises(RuntimeError) as exc:
        check_lightning_private()
    assert str(exc.value) == (f"lightning {L.__version__} changed private attributes llmforge uses "
                              "(llmforge/parallel/lightning_private.py): ModelParallelStrategy._setup_distributed")
