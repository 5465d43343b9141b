"""Keeping secrets out of what llmforge writes: secret-looking keys (``api_key``, ``*_token``,
``password``, ...; not ``max_tokens`` or ``eos_token``), their values wherever else they appear,
the environment's credential values, and ``user:password@`` in URLs.

One rule (:func:`is_secret_key`) decides what a secret is for every writer: the saved config,
``meta.json``, the run registry, the trackers' parameters, names and tags, and the command line
a tracker records (:func:`redact_argv`). Keys are compared after normalizing HTTP-header and
camelCase spellings (``X-Api-Key``, ``Private-Token``, ``apiKey`` are ``x_api_key``,
``private_token``, ``api_key``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any
from urllib.parse import unquote

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmforge.config.keycheck import _omega_message
from llmforge.errors import ConfigError

__all__ = ["is_secret_key", "is_secret_variable", "redact", "redact_argv", "remember_secret_values",
           "scrub_message", "scrub_url_credentials"]


# cookies, passphrases and the signatures of pre-signed URLs (X-Amz-Signature, Azure's sig=)
# carry access as much as keys do (issue 47, item 5)
_SECRET = re.compile(r"(?i)(api_?key|secret|passw(or)?d|passwd|passphrase|access_key|private_key|"
                     r"credential|auth|bearer|cookie|signature|^sig$|_sig$|_pat$|^pat$|^key$|_key$|"
                     r"^token$|_token$|connection_string|^pwd$|_pwd$|^pass$|_pass$|jwt|^session$|"
                     r"session_?id$|^(j|php)sess(ion)?id$)")
_NOT_SECRET = re.compile(r"(?i)(_tokens$|^(bos|eos|pad|unk|sep|cls|mask|start|end)_token$)")


_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_SEPARATORS = re.compile(r"[-\s]+")


def is_secret_key(key: Any) -> bool:
    """Whether a config key, HTTP header, URL query parameter or variable name names a secret
    (``api_key``, ``X-Api-Key``, ``Private-Token``, ``apiKey``, ``HF_TOKEN``, ``Cookie``,
    ``passphrase``, ``X-Amz-Signature``, ``X-Amz-Credential``, ``sig``, ``token``, ``pwd``,
    ``jwt``, ``JSESSIONID``; not ``max_tokens``, ``eos_token``). Environment variables:
    :func:`is_secret_variable`."""
    if not isinstance(key, str):
        return False
    key = _SEPARATORS.sub("_", _CAMEL.sub(r"\1_\2", key)).lower()
    return bool(_SECRET.search(key)) and not _NOT_SECRET.search(key)




_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def _env_names(key: Any, value: Any) -> bool:
    """``secrets: [WANDB_API_KEY, ...]`` lists environment variable NAMES, not values."""
    return key == "secrets" and isinstance(value, (list, tuple, ListConfig)) and all(
        isinstance(x, str) and _ENV_NAME.match(x) for x in value)


_SCHEME_WORD = re.compile(r"(?i)^(bearer|basic|token|digest|negotiate)\s+(\S+)$")


def _add_secret(value: Any, out: set) -> None:
    """``value`` (and, for ``Bearer TOKEN``, the bare token; for a mapping or list, each of its
    members) into ``out``: the token of a header appears bare elsewhere (``${variables.tok}``)."""
    if isinstance(value, dict):
        for v in value.values():
            _add_secret(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _add_secret(v, out)
    elif isinstance(value, (str, int)) and len(str(value)) >= 6:
        out.add(str(value))
        m = _SCHEME_WORD.match(str(value).strip())
        if m and len(m.group(2)) >= 6:
            out.add(m.group(2))


_REMEMBERED: set = set()


def remember_secret_values(values: Any) -> None:
    """Values never to print in a message, whatever key they reach (the environment variables
    a config interpolated, the values under its secret keys): :func:`scrub_message` removes
    them for the rest of the process (files keep them: a path from the environment stays a
    path in ``config.yaml``)."""
    _add_secret(list(values), _REMEMBERED)


def _secret_values(container: Any, out: set) -> set:
    """Every non-trivial string held under a secret-looking key, at any depth."""
    if isinstance(container, dict):
        for k, v in container.items():
            if is_secret_key(k) and not _env_names(k, v):
                _add_secret(v, out)
            _secret_values(v, out)
    elif isinstance(container, (list, tuple)):
        for v in container:
            _secret_values(v, out)
    return out


SHELL_VARIABLES = frozenset({"PWD", "OLDPWD", "XDG_SESSION_ID"})
"""Variables the shell and the login session set whose names read like secrets (``pwd`` is a
password's short name too): the working directory is no secret."""


def is_secret_variable(name: str) -> bool:
    """Whether an environment variable's name names a secret: :func:`is_secret_key`, except
    :data:`SHELL_VARIABLES`."""
    return name not in SHELL_VARIABLES and is_secret_key(name)


def _env_secret_values() -> set:
    """Values of the environment's credential variables (``*_API_KEY``, ``*_TOKEN``, ...)."""
    import os

    return {v for k, v in os.environ.items() if is_secret_variable(k) and v and len(v) >= 6}


# user:password@ or a bare token@ (https://ghp_xxx@github.com, s3://KEY@bucket), also after the
# extra slash fsspec puts in front of a path (memory:///KEY:SECRET@bucket in datasets' errors).
# A password runs to the first @ that a host follows: an AWS secret key holds '/' (s3://KEY:
# wJal/K7M@bucket) and a password may hold an unencoded @ (Python's URL parsing splits at the
# last); a path's @ (s3://bucket/a@b, hf://org/name@main) has no user: before it.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)(/?)(?:[^\s@:/]+:[^\s]*?|[^/\s@:]+)@"
                           r"(?=[^\s@/]*(?:[/?#\s'\"),\]]|$))")
_SSH = re.compile(r"(?i)^[a-z+]*ssh://")  # ssh://git@host: a user name, not a credential
# a query's parameters: name=value after ? and & (or ;), with or without the URL's scheme (a
# path printed through pathlib loses one of its slashes; an "extension" keeps only the query);
# a fragment's too (OAuth's implicit flow returns #access_token=...), and a path's parameters
# (Java's ;jsessionid=...)
_URL_QUERY = re.compile(r"([?#;])([^\s?#'\"<>\]]*)")
# a header written as one string (a list item, a whole value): "Authorization: Bearer X"
_HEADER_LINE = re.compile(r"(?i)^(\s*[a-z][a-z0-9_-]*)(\s*:\s*)(\S[^\n]*)$")
_QUERY_PARAM = re.compile(r"([^=&;]+)=([^&;]*)")


def _scrub_query(match: re.Match) -> str:
    params = _QUERY_PARAM.sub(lambda m: f"{m[1]}=***" if is_secret_key(unquote(m[1])) and m[2]
                              else m[0], match[2])
    return match[1] + params


def _scrub_header(match: re.Match) -> str:
    return f"{match[1]}{match[2]}***" if is_secret_key(match[1].strip()) else match[0]


def scrub_url_credentials(text: str) -> str:
    """``scheme://user:password@host/...`` -> ``scheme://***@host/...``, and the values of
    secret query parameters of a URL (a pre-signed object-store URL's ``X-Amz-Signature``,
    ``X-Amz-Credential``, ``X-Amz-Security-Token``, Azure's ``sig``, ``token=``, ``key=``:
    :func:`is_secret_key`) -> ``***``, anywhere in ``text``."""
    text = _URL_QUERY.sub(_scrub_query, _URL_USERINFO.sub(r"\1\2***@", text))
    return _HEADER_LINE.sub(_scrub_header, text) if ":" in text else text  # the whole string only


def strip_url_credentials(text: str) -> str:
    """``text`` with the credentials of its URLs left out, not masked: ``user:password@`` (or a
    bare ``token@``) removed, and a query's secret parameters (:func:`is_secret_key`) dropped;
    for a file llmforge writes that must load again (a masked ``***@`` is refused as a secret)."""
    def query(match: re.Match) -> str:
        params = re.split(r"[&;]", match[2])
        kept = [q for q in params if not ((kv := q.partition("="))[2] and is_secret_key(unquote(kv[0])))]
        if len(kept) == len(params):
            return match[0]  # not a query with secrets
        return match[1] + "&".join(kept) if kept else ""

    def url(match: re.Match) -> str:
        u = match[0] if _SSH.match(match[0]) and ":" not in match[0].split("://", 1)[1].split("@")[0] \
            else _URL_USERINFO.sub(r"\1\2", match[0])
        return _URL_QUERY.sub(query, u)

    return _URL.sub(url, text)  # URLs only: a "?" in a name or in prose stays


_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s'\"<>]*")


def _scrub(container: Any, values: set) -> Any:
    if isinstance(container, dict):
        return {k: _scrub(v, values) for k, v in container.items()}
    if isinstance(container, list):
        return [_scrub(v, values) for v in container]
    if isinstance(container, str):
        for secret in values:
            if secret in container:
                container = container.replace(secret, "***")
        container = scrub_url_credentials(container)
    return container


def config_to_dict(cfg: Any) -> Any:
    """Resolved plain container (dicts and lists) of a config, dataclass or dict.

    Raises:
        ConfigError: an interpolation cannot be resolved.
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = OmegaConf.structured(cfg)
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"cannot resolve the config: {_omega_message(exc)}") from None
    return copy.deepcopy(cfg)


def redact(container: Any) -> Any:
    """Return a copy of a (nested) dict/list, or a config, with secret-looking keys' values
    (``api_key``, ``wandb_api_key``, ``secret``, ``password``, ``passwd``, ``access_key``,
    ``private_key``, ``credentials``, ``key``, ``*_key``, ``*_pat``, ``token``, ``hf_token``; not
    ``max_tokens`` or ``eos_token``) replaced by ``"***"``. None stays None. Those values, and
    the values of the environment's credential variables (``WANDB_API_KEY``, ``HF_TOKEN``, ...),
    are also replaced wherever else they appear (e.g. interpolated into ``run.tags``), and so is
    the ``user:password@`` part of URLs (``https://user:pw@host/x`` -> ``https://***@host/x``)."""
    if isinstance(container, (DictConfig, ListConfig)) or dataclasses.is_dataclass(container):
        container = config_to_dict(container)
    values = _secret_values(container, set()) | _env_secret_values()
    return _scrub(_redact_keys(container), values)


def scrub_message(text: str) -> str:
    """An error message as the CLI prints it: :func:`redact`'s rules, and none of the values
    :func:`remember_secret_values` was given (an ``${oc.env:NAME}`` value a type or choice
    error would echo, whatever the variable's name)."""
    return _scrub(text, _env_secret_values() | _REMEMBERED)


def _redact_keys(container: Any) -> Any:
    if isinstance(container, dict):
        return {
            k: ("***" if is_secret_key(k) and v is not None and not _env_names(k, v) else _redact_keys(v))
            for k, v in container.items()
        }
    if isinstance(container, (list, tuple)):
        return [_redact_keys(v) for v in container]
    return container



def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-looking overrides (``variables.api_key=S``,
    ``data.storage_options.X-Api-Key=S``) replaced by ``***``, and those values, the
    environment's credential values and URL credentials removed from every other argument
    (e.g. ``run.tags=[S]``, or ``data.storage_options={X-Api-Key: S}``). What a tracker records
    as the run's command."""
    values = _env_secret_values()
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and any(is_secret_key(part) for part in key.lstrip("+~").split(".")):
            if len(value) >= 6:
                values.add(value)
            arg = f"{key}=***"
        elif eq and value.startswith(("{", "[")):  # a mapping such as {X-Api-Key: S} given as one value
            try:
                _secret_values(yaml.safe_load(value), values)
            except yaml.YAMLError:
                pass
        out.append(arg)
    return _scrub(out, values)
