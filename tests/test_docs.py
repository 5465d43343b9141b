"""The README (the front page) and the docs/ pages its sections moved to: docs/configuration.md
documents every YAML key exactly as the schema defines it; the examples on the pages work."""

from conftest import REPO
from llmforge.config.docs import key_table


def test_key_table_matches_schema():
    text = (REPO / "docs" / "configuration.md").read_text()
    begin, end = "<!-- keys:begin -->\n", "\n<!-- keys:end -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == key_table(), "regenerate with: python -m llmforge.config.docs"


def test_readme_quick_start_commands():
    text = (REPO / "README.md").read_text()
    assert "pip install torch==2.13.0" in text
    # what a CPU-only machine needs beside the public index (issue 27.3)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "llmforge train yamls/demo_cpu.yaml" in text
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -q" in text and "python -m pytest -q" in ci
    # the front page stays short (issue 46.4): the two commands are its first two fenced blocks
    assert len(text.splitlines()) <= 300
    blocks = text.split("```bash\n")[1:3]
    assert blocks[0].startswith("python3 -m venv .venv") and "llmforge train yamls/demo_cpu.yaml" in blocks[0]
    assert blocks[1].split("\n", 1)[0].endswith("python -m pytest -q")


def test_override_examples_load_on_the_demo():
    """docs/commands.md's override examples work on the file they name (issue 18.8)."""
    import re

    from llmforge.config import load_config

    text = (REPO / "docs" / "commands.md").read_text()
    bullet = text.split("- **Overrides**", 1)[1].split("\n- **", 1)[0]
    examples = [e.strip("'") for e in re.findall(r"`([^`]+=[^`]*)`", bullet)]
    assert "'algorithms=[{name: compile}]'" in bullet and len(examples) >= 6
    for example in examples:
        cfg = load_config(REPO / "yamls" / "demo_cpu.yaml", [example.replace("key=", "run.group=")])
        assert cfg is not None
    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml",
                      ["algorithms=[{name: compile}]", "loggers.0.name=tensorboard"])
    assert (cfg.algorithms[0]["name"], cfg.loggers[0]["name"]) == ("compile", "tensorboard")


def test_extending_page_names_every_trainer_builder():
    """The builders a research subclass overrides are named in docs/extending.md, not found by
    inspect (issue 27.6)."""
    from llmforge import LLMModule, Trainer

    text = (REPO / "docs" / "extending.md").read_text()
    builders = [n for n in dir(Trainer) if n.startswith("build_")] + ["build_model"]
    assert len(builders) >= 10 and hasattr(LLMModule, "build_model")
    assert [n for n in builders if f"`{n}(" not in text] == []
