"""The entries of ``data.mixture``: checked, opened (prepared folders and streaming document
sources), and reported by ``--dry-run``.

An entry is a prepared folder (``{source: prepared, path, weight, name}``) or a streaming
document source whose keys are those of ``data:`` (``source: files|hub|shakespeare``, ``path``,
``paths``, ``format``, ``text_field``, ``split``, ``storage_options``, ``max_documents``;
``hub_name`` is ``data.name``, the Hub configuration, since ``name`` names the entry), merged
over the run's ``data:`` section. An entry without ``source`` takes ``data.source``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from llmforge.errors import DataError

from llmforge.config.mixture import mixture_entries
from llmforge.config.redaction import scrub_url_credentials
from llmforge.data.prepared import open_prepared, tokenizer_fingerprint
from llmforge.data.sources import hash_str, iter_texts, load_documents, plain_options
from llmforge.data.tokenizer_base import META_FILE


@dataclass
class PreparedMixture:
    """The data module's input for ``data.mixture``: the checked entries and, in order, each
    one's opened source: a prepared folder (:class:`llmforge.data.prepared.PreparedSplits`) or
    streaming documents (:class:`llmforge.data.sources.DocumentSplits`, ``val`` None)."""

    entries: list[dict[str, Any]]
    parts: list[Any]

    @property
    def prepared(self) -> list[Any]:
        """The prepared folders, in entry order."""
        return [p for e, p in zip(self.entries, self.parts) if e["source"] == "prepared"]

    @property
    def fingerprint(self) -> str:
        """Where the documents come from (the cache key of a tokenizer trained on them)."""
        return hash_str(repr([(e["name"], e["share"], getattr(p, "fingerprint", None))
                              for e, p in zip(self.entries, self.parts)]))

    def texts(self, max_bytes: Optional[int]) -> Iterator[str]:
        """Texts of the streaming entries, each up to its share of ``max_bytes`` (what
        ``tokenizer.type: train_bpe`` trains on when no entry is prepared)."""
        return itertools.chain.from_iterable(
            iter_texts(p.train, None if max_bytes is None else max(1, int(max_bytes * e["share"])), p.files)
            for e, p in zip(self.entries, self.parts) if e["source"] != "prepared")


def check_one_tokenizer(docs: PreparedMixture, tok: Any) -> None:
    """Every prepared entry was written by ``tok`` (the first prepared entry's tokenizer).

    Raises:
        DataError: names the entry whose fingerprint differs and how to prepare it again.
    """
    have = tokenizer_fingerprint(tok)
    prepared = [(i, p) for i, (e, p) in enumerate(zip(docs.entries, docs.parts)) if e["source"] == "prepared"]
    (first, root), rest = (prepared[0][0], prepared[0][1].root), prepared[1:]
    for i, part in rest:
        if part.fingerprint != have:
            raise DataError(
                f"data.mixture[{i}].path: {part.root} was prepared with another tokenizer (fingerprint "
                f"{part.fingerprint}) than data.mixture[{first}] ({root}, fingerprint {have}); the "
                "prepared entries of a mixture share one tokenizer: prepare it again with the "
                f"one saved in {root / 'tokenizer'} ({_saved_tokenizer_overrides(root)}; docs/data.md)")


def _saved_tokenizer_overrides(root: Any) -> str:
    """The ``tokenizer.type=... tokenizer.path=...`` overrides that load ``root/tokenizer``."""
    import json

    try:
        meta = json.loads((root / "tokenizer" / META_FILE).read_text())
        return f"tokenizer.type={meta['type']} tokenizer.path={root / 'tokenizer' / meta['file']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "tokenizer.type and tokenizer.path of its files"



def _entry_error(i: int, exc: DataError) -> DataError:
    """``exc`` (about ``data.KEY``) renamed to the entry's key ``data.mixture[i].KEY``."""
    msg = str(exc)
    for prefix in ("data.", "data: "):
        if msg.startswith(prefix):
            return DataError(f"data.mixture[{i}]{'.' if prefix == 'data.' else ': '}{msg[len(prefix):]}")
    return DataError(f"data.mixture[{i}]: {msg}")


def open_mixture(cfg: Any) -> PreparedMixture:
    """Open every entry of ``data.mixture``: prepared folders checked against their manifests,
    streaming sources loaded lazily (:func:`llmforge.data.sources.load_documents`).

    Raises:
        ConfigError: a bad entry (:func:`mixture_entries`).
        DataError: a folder or source that cannot be read (the message names the entry).
    """
    entries = mixture_entries(cfg)
    parts = []
    for i, e in enumerate(entries):
        try:
            parts.append(open_prepared(e["path"], storage_options=plain_options(cfg.data.storage_options),
                                       cache_dir=cfg.data.cache_dir) if e["data"] is None
                         else load_documents(e["data"], cfg.run.seed))
        except DataError as exc:
            raise _entry_error(i, exc) from exc
    return PreparedMixture(entries, parts)


def mixture_report(cfg: Any, tokens_per_step: int) -> list[str]:
    """``--dry-run`` lines: each source's share and tokens per optimizer step (URL credentials
    shown as ``***``)."""
    return [scrub_url_credentials(f"mixture         {e['name']}: {e['share']:.1%} share, ~{e['share'] * tokens_per_step:,.0f} "
            f"tokens per step ({e['path']}{'' if e['data'] is None else ', ' + e['source'] + ' streaming'})")
            for e in mixture_entries(cfg)]
