"""The documents of a run's source, read now or at their first use (:class:`DocumentSplits`);
built by :func:`llmforge.data.sources.load_documents`; and the one import of Hugging Face
``datasets`` (:func:`hf_datasets`)."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    import datasets

AnyDataset = Union["datasets.Dataset", "datasets.IterableDataset"]

__all__ = ["AnyDataset", "DocumentSplits", "hf_datasets", "is_stream"]


def hf_datasets() -> ModuleType:
    """The ``datasets`` module, imported at its first use and quieted (no progress bars, errors
    only). Imported with the package, it and what it pulls in (pyarrow, pandas, fsspec) held
    about 80 MiB of every run's resident memory and took ~0.7 s at start (measured on the demo,
    issue 30), though a run on cached ids (:mod:`llmforge.data.token_cache`) or prepared shards
    never opens a document."""
    import datasets  # heavy (see above): only where documents are read

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def is_stream(ds: Any) -> bool:
    """Whether ``ds`` is a ``datasets.IterableDataset`` (a streaming source), without importing
    ``datasets``: an object of its classes exists only once it is imported."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(ds, module.IterableDataset)


class DocumentSplits:
    """Train and validation documents, with a fingerprint of where they came from.

    Built with ``load`` (a callable returning ``(train, val)``), the splits are read at the
    first access of :attr:`train` or :attr:`val`: a run whose token cache holds both splits
    (:mod:`llmforge.data.token_cache`) never reads them. ``key`` names the documents for that
    cache (``""``: not cacheable); ``has_val`` says whether they have a validation split
    without reading them (``None``: not known).
    """

    def __init__(self, train: Optional[AnyDataset] = None, val: Optional[AnyDataset] = None,
                 fingerprint: str = "", files: tuple[str, ...] = (),
                 storage_options: Optional[dict] = None, *,
                 load: Optional[Callable[[], tuple[AnyDataset, Optional[AnyDataset]]]] = None,
                 key: str = "", has_val: Optional[bool] = None) -> None:
        self._splits = None if load is not None else (train, val)
        self.has_val = has_val if load is not None else val is not None
        self._load = load
        self.fingerprint, self.key = fingerprint, key
        self.files = files  # the local or remote files read (named by a read error)
        self.storage_options = storage_options  # fsspec options of remote files (file_identities)

    @property
    def loaded(self) -> bool:
        """Whether the splits have been read."""
        return self._splits is not None

    def _read(self) -> tuple[AnyDataset, Optional[AnyDataset]]:
        if self._splits is None:
            assert self._load is not None
            self._splits = self._load()
        return self._splits

    @property
    def train(self) -> AnyDataset:
        return self._read()[0]

    @property
    def val(self) -> Optional[AnyDataset]:
        return self._read()[1]
