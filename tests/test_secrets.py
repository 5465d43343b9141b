"""One rule for what a secret is (issue 21, item 8): config keys, HTTP-header spellings
(``X-Api-Key``, ``Private-Token``), camelCase and environment variable names, and the command
line a tracker records. The grep of every file a run writes is in test_loggers.py (its one run
with every offline tracker carries these secrets)."""

from __future__ import annotations

import pytest

from llmforge.config.redaction import is_secret_key, redact, redact_argv

HEADER_KEY = "hdr-value-" + "A1" * 8
PRIVATE_TOKEN = "glpat-" + "B2" * 8
ARGV_KEY = "argv-value-" + "C3" * 8


@pytest.mark.parametrize("key, secret", [
    ("X-Api-Key", True), ("Private-Token", True), ("apiKey", True), ("Authorization", True),
    ("HF_TOKEN", True), ("api_key", True), ("max_tokens", False), ("eos_token", False),
    ("maxTokens", False), ("Content-Type", False), ("name", False),
])
def test_one_rule_for_keys_headers_and_variables(key, secret):
    assert is_secret_key(key) is secret
    from llmforge.runs.credentials import is_secret_name

    if key.isupper():  # environment variable names: the same rule
        assert is_secret_name(key) is secret


def test_redact_argv_hides_values_of_secret_overrides_wherever_they_appear():
    argv = ["train", "x.yaml", f"variables.api_key={ARGV_KEY}", f"run.tags=[{ARGV_KEY},ok]",
            f"+data.storage_options.X-Api-Key={HEADER_KEY}", "trainer.max_steps=2",
            f"data.storage_options={{Private-Token: {PRIVATE_TOKEN}, Accept: text}}"]
    assert redact_argv(argv) == ["train", "x.yaml", "variables.api_key=***", "run.tags=[***,ok]",
                                 "+data.storage_options.X-Api-Key=***", "trainer.max_steps=2",
                                 "data.storage_options={Private-Token: ***, Accept: text}"]
    assert redact({"h": {"X-Api-Key": HEADER_KEY, "Private-Token": PRIVATE_TOKEN, "Accept": "x"}}) == \
        {"h": {"X-Api-Key": "***", "Private-Token": "***", "Accept": "x"}}
