"""One rule for what a secret is (issue 21, item 8): config keys, HTTP-header spellings
(``X-Api-Key``, ``Private-Token``), camelCase and environment variable names, and the command
line a tracker records. The grep of every file a run writes is in test_loggers.py (its one run
with every offline tracker carries these secrets)."""

from __future__ import annotations

import pytest

from conftest import DEMO, TINY_OVERRIDES
from llmforge.cli import main
from llmforge.config.redaction import is_secret_key, redact, redact_argv

HEADER_KEY = "hdr-value-" + "A1" * 8
PRIVATE_TOKEN = "glpat-" + "B2" * 8
ARGV_KEY = "argv-value-" + "C3" * 8


@pytest.mark.parametrize("key, secret", [
    ("X-Api-Key", True), ("Private-Token", True), ("apiKey", True), ("Authorization", True),
    ("HF_TOKEN", True), ("api_key", True), ("max_tokens", False), ("eos_token", False),
    ("maxTokens", False), ("Content-Type", False), ("name", False),
    # issue 47, item 5: what HTTP and object stores carry
    ("Cookie", True), ("Set-Cookie", True), ("passphrase", True), ("X-Amz-Signature", True),
    ("X-Amz-Credential", True), ("X-Amz-Security-Token", True), ("sig", True), ("design", False),
    ("X-Amz-Date", False), ("signal", False),
    ("pwd", True), ("db_pass", True), ("jwt", True), ("session_id", True), ("passes", False),
    ("bypass", False), ("num_sessions", False),
])
def test_one_rule_for_keys_headers_and_variables(key, secret):
    assert is_secret_key(key) is secret
    from llmforge.runs.credentials import is_secret_name

    if key.isupper():  # environment variable names: the same rule
        assert is_secret_name(key) is secret


def test_secret_query_parameters_of_signed_urls_are_redacted_inside_any_value():
    from llmforge.config.redaction import scrub_url_credentials

    url = ("see https://b.s3.amazonaws.com/x?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F1"
           "&X-Amz-Signature=abc123&versionId=7 and https://a.blob.core.windows.net/c/x?sv=2024&sig=Zz%3D#f")
    assert scrub_url_credentials(url) == (
        "see https://b.s3.amazonaws.com/x?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
        "&X-Amz-Signature=***&versionId=7 and https://a.blob.core.windows.net/c/x?sv=2024&sig=***#f")
    assert redact({"mirror": "https://h/x?token=t0k3n-value", "headers": {"Cookie": "s=abcdefgh"},
                   "note": "cookie s=abcdefgh"}) == {"mirror": "https://h/x?token=***",
                                                      "headers": {"Cookie": "***"}, "note": "cookie ***"}


def test_url_passwords_holding_a_slash_or_an_at_are_masked_whole_and_paths_keep_theirs():
    """An AWS secret key holds '/' (s3://KEY:wJal/K7M@bucket) and a password may hold an
    unencoded '@': the user info ended at the first '/', so the rest of the key was printed
    (and written by `convert foundry`). A path's '@' (s3://bucket/a@b, hf://org/x@main) stays."""
    from llmforge.config.redaction import scrub_url_credentials, strip_url_credentials

    cases = {"s3://AKIAFAKE:wJalr/K7MD/bPxR@bucket/ckpt": ("s3://***@bucket/ckpt", "s3://bucket/ckpt"),
             "https://me:p@ssw0rdSECRET@host/mlflow": ("https://***@host/mlflow", "https://host/mlflow"),
             "https://u:p@host/a@b": ("https://***@host/a@b", "https://host/a@b"),
             "s3://bucket/a@b/key": ("s3://bucket/a@b/key",) * 2,
             "hf://datasets/org/name@main/data": ("hf://datasets/org/name@main/data",) * 2,
             "git+ssh://git@github.com/org/repo": ("git+ssh://***@github.com/org/repo",
                                                  "git+ssh://git@github.com/org/repo"),
             "https://h/x?a=1;token=SEMI": ("https://h/x?a=1;token=***", "https://h/x?a=1"),
             # a fragment's parameters (OAuth's implicit flow) and short password names
             "https://h/cb#access_token=FRAG&state=2": ("https://h/cb#access_token=***&state=2",
                                                       "https://h/cb#state=2"),
             "https://h/db?user=me&pwd=PWD#top": ("https://h/db?user=me&pwd=***#top", "https://h/db?user=me#top"),
             "https://h/docs#section-2": ("https://h/docs#section-2",) * 2,
             "https://h/app;jsessionid=JSID?x=1": ("https://h/app;jsessionid=***?x=1", "https://h/app?x=1"),
             "run what?token=xyz": ("run what?token=***", "run what?token=xyz")}  # no URL: kept
    for text, (masked, stripped) in cases.items():
        assert (scrub_url_credentials(text), strip_url_credentials(text)) == (masked, stripped), text


def test_redact_argv_hides_values_of_secret_overrides_wherever_they_appear():
    argv = ["train", "x.yaml", f"variables.api_key={ARGV_KEY}", f"run.tags=[{ARGV_KEY},ok]",
            f"+data.storage_options.X-Api-Key={HEADER_KEY}", "trainer.max_steps=2",
            f"data.storage_options={{Private-Token: {PRIVATE_TOKEN}, Accept: text}}"]
    assert redact_argv(argv) == ["train", "x.yaml", "variables.api_key=***", "run.tags=[***,ok]",
                                 "+data.storage_options.X-Api-Key=***", "trainer.max_steps=2",
                                 "data.storage_options={Private-Token: ***, Accept: text}"]
    assert redact({"h": {"X-Api-Key": HEADER_KEY, "Private-Token": PRIVATE_TOKEN, "Accept": "x"}}) == \
        {"h": {"X-Api-Key": "***", "Private-Token": "***", "Accept": "x"}}


@pytest.mark.parametrize("override", ["run.name=r-${variables.api_key}",
                                      "run.output_dir={tmp}/${variables.api_key}",
                                      "checkpoint.dir={tmp}/ck-${variables.api_key}"])
def test_a_secret_in_a_folder_name_is_refused_before_anything_is_written(tmp_path, capsys, override):
    """A folder name cannot be redacted (the run directory, every path under it, the printed
    lines): `run.name: r-${variables.api_key}` is refused with exit 2, nothing created."""
    key = override.split("=")[0]
    rc = main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path / 'runs'}",
               "variables.api_key=SeKrEt123",
               override.replace("{tmp}", str(tmp_path))])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {key}=") and "holds a secret" in err, err
    assert "SeKrEt123" not in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_working_directory_is_no_secret_although_pwd_names_a_password(tmp_path, capsys, monkeypatch):
    """``pwd=`` is a password's short name (a database URL's query), but the shell's ``PWD`` is
    the working directory: as a secret variable it masked every path under it, and a run
    directory there was refused as holding a secret."""
    from llmforge.runs.credentials import is_secret_name

    assert is_secret_key("pwd") and not is_secret_name("PWD") and not is_secret_name("OLDPWD")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", str(tmp_path))
    assert redact({"path": f"{tmp_path}/corpus.jsonl"}) == {"path": f"{tmp_path}/corpus.jsonl"}
    assert main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path}/runs", "--dry-run"]) == 0
    assert "***" not in capsys.readouterr().out


def test_a_type_error_from_an_environment_variable_never_prints_its_value(tmp_path, capsys, monkeypatch):
    """Issue 47, item 3: ``${oc.env:HOOK}`` with a value of the wrong type names the key, the
    interpolation and the types, never the value (whatever the variable's name)."""
    monkeypatch.setenv("HOOK", "https://hooks.example.com/T0/" + "W4" * 10)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {DEMO}\ntrainer:\n  max_steps: ${{oc.env:HOOK}}\n")
    assert main(["train", str(cfg), "--dry-run"]) == 2
    assert capsys.readouterr().err == ("error: trainer.max_steps: expected an integer, got a string "
                                       "from interpolation '${oc.env:HOOK}'\n")


def test_choice_errors_and_echoes_of_secret_keys_print_no_value(tmp_path, capsys, monkeypatch):
    """A value from ${oc.env:...} or from a secret key, echoed by a choice or type error of
    another key, is printed as *** (issue 47: no message prints an environment value); a
    bearer token and header strings are redacted where they stand and wherever else they appear."""
    hook = "https://hooks.example.com/T0/" + "W4" * 10
    monkeypatch.setenv("HOOK", hook)
    cases = [("trainer.precision=${oc.env:HOOK}", "error: trainer.precision: expected one of "),
             ("data.source=${oc.env:HOOK}", "error: data.source: expected one of "),
             ("trainer.max_steps=${data.storage_options.headers.Cookie}", "error: trainer.max_steps: ")]
    for override, says in cases:
        assert main(["train", DEMO, "data.storage_options.headers.Cookie=sid-PLANTED-42", override,
                     "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(says) and "***" in err and hook not in err and "PLANTED" not in err, err
    token = "tok-" + "Z9" * 8
    shown = redact({"h": {"Authorization": f"Bearer {token}"}, "tags": [token],
                    "list": ["Cookie: sid=abcdefgh", f"Authorization: Bearer {token}"],
                    "path": f"/x/https:/h/f.json?X-Amz-Signature=abcdef12"})
    assert shown == {"h": {"Authorization": "***"}, "tags": ["***"],
                     "list": ["Cookie: ***", "Authorization: ***"],
                     "path": "/x/https:/h/f.json?X-Amz-Signature=***"}
