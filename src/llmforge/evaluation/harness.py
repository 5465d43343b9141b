"""EleutherAI's lm-evaluation-harness on llmforge models.

:class:`LLMForgeLM` is an ``lm_eval`` model adapter (a ``TemplateLM``): it scores
log-likelihoods and generates with any llmforge model (plain, or sharded by FSDP2 / tensor
parallel while training) and its tokenizer. :func:`evaluate_harness` runs chosen tasks through
``lm_eval.simple_evaluate`` (the library, not its CLI) and returns flat scores
``{"<task>/<metric>": value}``.

Tasks come from lm-eval's registry (``hellaswag``, ``lambada_openai``, ...: their datasets are
downloaded from the Hugging Face Hub, so they need network or a filled ``HF_DATASETS_CACHE``)
or from task YAML files in ``include_path`` folders, which may point at local files, e.g.::

    task: my_mc
    dataset_path: json
    dataset_kwargs: {data_files: {test: /data/my_mc.jsonl}}
    test_split: test
    output_type: multiple_choice
    doc_to_text: "{{question}}"
    doc_to_choice: "{{choices}}"
    doc_to_target: "{{answer}}"
    metric_list: [{metric: acc}]

Requires the ``eval`` extra: ``pip install 'llmforge[eval]'`` (``lm_eval``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.models.sampling import generate


def import_lm_eval() -> Any:
    """Import ``lm_eval`` or raise :class:`ConfigError` saying which extra installs it."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
    except ImportError as e:
        raise ConfigError("evaluation needs EleutherAI's lm-evaluation-harness: "
                          "pip install 'llmforge[eval]' (or pip install lm_eval)") from e
    return lm_eval


def _template_lm() -> type:
    return import_lm_eval().api.model.TemplateLM


def make_lm(model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8,
            max_gen_toks: int = 256, device: Optional[torch.device] = None) -> Any:
    """Build an :class:`LLMForgeLM` (the class is created on first use, so that importing this
    module does not import ``lm_eval``)."""
    return _lm_class()(model, tokenizer, batch_size=batch_size, max_gen_toks=max_gen_toks,
                       device=device)


_LM_CLASS: Optional[type] = None


def _lm_class() -> type:
    global _LM_CLASS
    if _LM_CLASS is None:
        _LM_CLASS = type("LLMForgeLM", (LLMForgeLMMixin, _template_lm()), {})
        _LM_CLASS.__doc__ = LLMForgeLMMixin.__doc__
        _LM_CLASS.__module__ = __name__
    return _LM_CLASS


class LLMForgeLMMixin:
    """lm-eval model adapter for an llmforge model and tokenizer (``lm_eval.api.model.TemplateLM``).

    Args:
        model: ``forward(tokens [B, T] int64) -> logits [B, T, V]``; attribute ``max_seq_len``
            (the longest context, in tokens). Run in eval mode under ``torch.no_grad``; its
            training mode is restored after each call.
        tokenizer: an llmforge :class:`~llmforge.data.tokenizers.Tokenizer` (``encode``,
            ``decode``, ``bos_id``, ``eos_id``).
        batch_size: sequences per forward pass when scoring.
        max_gen_toks: default cap on generated tokens (a task's ``max_gen_toks`` wins).
        device: where inputs go; default: the device of the model's first parameter.

    Scoring (``loglikelihood``): context and continuation are encoded together, the last
    ``max_seq_len + 1`` tokens kept, and the continuation's summed log-probability (nats) and
    whether it is the greedy continuation returned. Sequences of one batch are right-padded
    (a causal model's earlier positions do not see the padding). ``loglikelihood_rolling``
    scores a whole text in disjoint windows of ``max_seq_len`` tokens (lm-eval's rolling
    windows; first window conditioned on BOS). ``generate_until`` decodes greedily (or with the
    task's ``temperature``) until a stop string, the EOS token or ``max_gen_toks``.

    Every process evaluates every request (``world_size`` is reported as 1), so a model sharded
    over several ranks runs the same forward passes in lockstep on each of them.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8,
                 max_gen_toks: int = 256, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.model, self.tok = model, tokenizer
        self.batch_size, self._max_gen_toks = int(batch_size), int(max_gen_toks)
        if device is None:
            p = next(iter(model.parameters()), None)
            device = getattr(p, "device", torch.device("cpu")) if p is not None else torch.device("cpu")
        self._device = torch.device(device)
        self.max_length = int(getattr(model, "max_seq_len", 2048))

    # ---------------------------------------------------------------- tokenization
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string, bos=bool(add_special_tokens))

    def tok_decode(self, tokens: Iterable[int], **kwargs: Any) -> str:
        return self.tok.decode(list(tokens))

    # ---------------------------------------------------------------- scoring
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Right-padded forward: ``rows`` (each ``<= max_seq_len`` ids) -> fp32 log-probs
        ``[B, T_max, V]``."""
        width = max(len(r) for r in rows)
        pad = self.tok.eos_id
        x = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long,
                         device=self._device)
        return F.log_softmax(self.model(x).float(), dim=-1)

    def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(context ids, continuation ids)`` -> ``(sum log p(continuation), greedy?)`` each."""
        out: list[tuple[float, bool]] = []
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for i in range(0, len(pairs), self.batch_size):
                    chunk = pairs[i:i + self.batch_size]
                    rows, spans = [], []
                    for ctx, cont in chunk:
                        if not cont:
                            raise LLMForgeError("lm-eval asked to score an empty continuation")
                        whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
                        n = min(len(cont), len(whole) - 1)
                        rows.append(whole[:-1])
                        spans.append((len(whole) - 1 - n, whole[-n:]))
                    logp = self._logits(rows)
                    for b, (start, target) in enumerate(spans):
                        lp = logp[b, start:start + len(target)]
                        t = torch.tensor(target, device=lp.device)
                        total = lp.gather(-1, t[:, None]).sum().item()
                        greedy = bool((lp.argmax(-1) == t).all())
                        out.append((total, greedy))
        finally:
            self.model.train(training)
        return out

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        """``[((context, continuation), context ids, continuation ids)]`` -> ``[(logprob, greedy)]``;
        results are cached in lm-eval's partial-result cache hook."""
        results = self._score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood (nats) of each whole text (``Instance.args == (text,)``)."""
        from lm_eval import utils

        out = []
        for req in requests:
            (text,) = req.args
            windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(lp for lp, _ in self._score([(list(c), list(t)) for c, t in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continue each context (``Instance.args == (context, gen_kwargs)``) until one of
        ``gen_kwargs["until"]``, the EOS token or ``max_gen_toks`` tokens."""
        out = []
        for req in requests:
            context, kw = req.args
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", self._max_gen_toks))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            ids = self.tok_encode(context, add_special_tokens=True)
            room = max(1, self.max_length - max_new)
            new = generate(self.model, ids[-room:], max_new, temperature=temperature,
                           top_k=None, eos_id=self.tok.eos_id,
                           generator=torch.Generator().manual_seed(0))
            text = self.tok_decode([i for i in new if i != self.tok.eos_id])
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out


def parse_limit(limit: Any) -> Optional[float]:
    """lm-eval's ``limit`` checked: ``None`` (every document), a whole count >= 1 (returned as
    ``int``) or a share of each task's documents in (0, 1) (returned as ``float``).

    Raises:
        ValueError: not a number, a bool, <= 0, or >= 1 but not whole (e.g. ``2.5``).
    """
    if limit is None:
        return None
    if not isinstance(limit, bool) and isinstance(limit, (int, float)) and math.isfinite(limit):
        if 0 < limit < 1:
            return float(limit)
        if 1 <= limit < 2**62 and float(limit).is_integer():
            return int(limit)
    raise ValueError(f"limit must be a whole count in [1, 2**62) or a share in (0, 1); got {limit!r}")


def flatten_results(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``results["results"]`` -> ``{"<task>/<metric>": value}`` for finite numbers
    (the filter suffix ``,none`` dropped; standard errors kept as ``<metric>_stderr``)."""
    flat: dict[str, float] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            if key in ("alias", "sample_len", "sample_count") or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(float(value)):
                continue
            name, _, filt = key.partition(",")
            name = name if filt in ("", "none") else f"{name}_{filt}"
            flat[f"{task}/{name}"] = float(value)
    return flat


_MANAGERS: dict[tuple, Any] = {}


def task_manager(tasks: Sequence[str], include_path: Sequence[str] = ()) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks``, cached per (tasks, include_path).

    lm-eval indexes its ~15,000 built-in task YAMLs in 10-40 s; when every task is defined in
    ``include_path`` only those folders are indexed.

    Raises:
        ConfigError: a task name neither lm-eval nor ``include_path`` defines (the message lists
            close names).
    """
    from lm_eval.tasks import TaskManager

    paths = []
    for p in include_path:
        path = Path(p).expanduser()
        if not path.exists():
            raise ConfigError(f"eval: include_path {path} does not exist")
        paths.append(str(path.parent if path.is_file() else path))  # a task file: its folder
    key = (tuple(tasks), tuple(paths))
    if key in _MANAGERS:
        return _MANAGERS[key]
    manager = None
    if paths:
        manager = TaskManager(include_path=paths, include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=paths or None)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        import difflib

        hints = {t: difflib.get_close_matches(t, sorted(known), n=3) for t in unknown}
        raise ConfigError("eval: unknown lm-eval task(s): " + "; ".join(
            f"{t!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for t, h in hints.items())
            + ("; if one is defined in include_path, check that its YAML parses and names it "
               "under task:" if paths else "; local task YAMLs go in a folder given as include_path"))
    _MANAGERS[key] = manager
    return manager


def evaluate_harness(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[str], *,
                     include_path: Optional[Sequence[str | Path]] = None,
                     limit: Optional[int | float] = None, num_fewshot: Optional[int] = None,
                     batch_size: int = 8, max_gen_toks: int = 256, seed: int = 0,
                     verbose: bool = False) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on ``model`` and return ``{"scores": {"<task>/<metric>": value},
    "results": lm-eval's per-task results, "versions", "n_samples"}``.

    Args:
        tasks: task or group names known to lm-eval or defined in ``include_path``.
        include_path: folders (or files) of extra task YAMLs.
        limit: at most this many documents per task (an int) or this share (a float < 1).
        num_fewshot: few-shot examples per prompt (``None``: the task's default).
        batch_size: sequences per forward pass when scoring.
        seed: lm-eval's Python, NumPy, torch and few-shot seeds.
        verbose: keep lm-eval's INFO logging (default: warnings only).

    Raises:
        ConfigError: ``lm_eval`` missing, no task given, or a task name lm-eval does not know
            (the message lists close names).
    """
    lm_eval = import_lm_eval()
    tasks = [t.strip() for t in tasks if t and t.strip()]
    if not tasks:
        raise ConfigError("eval: give at least one task, e.g. --tasks hellaswag,lambada_openai")
    paths = [str(p) for p in (include_path or [])]
    if not verbose:
        for name in ("lm-eval", "lm_eval", "lm_eval.evaluator", "lm_eval.api.task"):
            logging.getLogger(name).setLevel(logging.WARNING)
    manager = task_manager(tasks, paths)
    lm = make_lm(model, tokenizer, batch_size=batch_size, max_gen_toks=max_gen_toks)
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=False,
                                      bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed,
                                      verbosity="WARNING" if not verbose else "INFO")
    except Exception as e:  # bad task data or template: missing file, Jinja errors, ...
        import jinja2

        if isinstance(e, ConnectionError):  # a hub task's data with no network (HF offline)
            raise ConfigError(f"eval: lm-eval could not fetch the data of {', '.join(tasks)} (no "
                              "network, or HF_DATASETS_OFFLINE=1): download it where the hub is "
                              "reachable first, or give local task YAMLs with --include-path") from e
        if not isinstance(e, (FileNotFoundError, ValueError, KeyError, jinja2.TemplateError)):
            raise
        where = f" (task YAMLs in {', '.join(paths)})" if paths else ""
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"eval: lm-eval could not run {', '.join(tasks)}{where}: "
                          f"{type(e).__name__}: {first[:300]}") from e
    res = res or {}
    return {"scores": flatten_results(res), "results": res.get("results", {}),
            "versions": {k: v for k, v in (res.get("versions") or {}).items()},
            "n_samples": res.get("n-samples", {})}
