"""The sections that define the mathematics of a run: what is trained on what, and how.

Every field carries a ``help`` text (docs/reference/configuration.md is generated from them:
``elastic-runner config --docs``) and every section a ``validate()`` that says what to set instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .base import ConfigError, _help, is_import_path


@dataclass
class RunConfig:
    """Where the run lives and how it is seeded."""

    dir: str = _help(
        "Directory for everything the run writes: snapshots, audit trail, event log, "
        "effective config. Shared by all nodes (a shared filesystem or PVC in production).",
        default="runs/default",
    )
    seed: int = _help("Seed for model init, data order and per-step randomness.", default=0)
    deterministic: bool = _help(
        "Use deterministic algorithms (torch.use_deterministic_algorithms, cuDNN "
        "deterministic). Needed for bitwise-reproducible GPU runs; slower.",
        default=False,
    )

    def validate(self) -> None:
        if not self.dir.strip():
            raise ConfigError("run.dir", "is empty", "Set run.dir to a directory path, e.g. runs/exp1")


@dataclass
class DataConfig:
    """The training and test data: a built-in dataset or an import path, and how it is sampled and loaded."""

    name: str = _help(
        "Dataset: digits (8x8 handwritten digits shipped with the package), synthetic, "
        "tokens (token files from 'elastic-runner data prepare-text'), image_folder, cifar10, fake_images "
        "(deterministic learnable images, no download), or an "
        "import path 'package.module:callable' returning a (train, test) pair or a train dataset "
        "(items: any nesting of tensors, numbers, tuples, lists, dicts, dataclasses).",
        default="digits",
    )
    path: str | None = _help(
        "Dataset directory (required for tokens, image_folder and cifar10).", default=None
    )
    params: dict[str, Any] = _help(
        "Keyword arguments for the dataset builder (synthetic: size, shape, num_classes, test_size; "
        "tokens: block_size, text (a UTF-8 file prepared into data.path on first use); image_folder: image_size; fake_images: size, test_size, num_classes, "
        "image_size, noise; import paths: anything the callable accepts).",
        default_factory=dict,
    )
    collate: str | None = _help(
        "Import path of a function that turns a list of items into a batch (e.g. one that pads "
        "variable-length sequences); null: torch's default_collate.",
        default=None,
    )
    test_fraction: float = _help(
        "Share of the digits dataset held out for evaluation.", default=0.2
    )
    shuffle: bool = _help("Shuffle the sample order every epoch (seeded).", default=True)
    partial_batch: Literal["drop", "partial"] = _help(
        "Last global batch of an epoch when the dataset size is not a multiple of "
        "batch.global_size: drop (skip those samples this epoch) or partial (one smaller "
        "step; the loss is still the exact mean over its samples). Samples are never repeated.",
        default="drop",
    )
    augment: list[Any] | None = _help(
        "Random augmentation of the training images (image_folder, cifar10, fake_images): torchvision "
        "transforms.v2 by name and parameters, e.g. [{RandomCrop: {size: 32, padding: 4}}, "
        "RandomHorizontalFlip, {Normalize: {mean: [...], std: [...]}}]. Every draw is seeded by (run.seed, "
        "epoch, sample index), so a resumed run sees the same images at any world size and data.num_workers. "
        "Normalize entries apply to the test split too.",
        default=None,
    )
    bad_images: Literal["fail", "skip"] = _help(
        "An image that cannot be decoded: fail (the run stops with one line naming the file, exit status 2, "
        "not restarted) or skip (every image is checked once when the dataset is built and the undecodable "
        "ones are left out, named in a warning).",
        default="fail",
    )
    num_workers: int = _help(
        "DataLoader worker processes for file-backed datasets (in-memory datasets ignore it). They start at each "
        "epoch, or with recovery.in_process live as long as their training process (every epoch and recovery).",
        default=0,
    )
    eval_batch_size: int = _help("Per-rank batch size for evaluation.", default=256)
    sampler: str = _help(
        "Sample order: 'elastic' (exactly-once across restarts and world sizes) or an "
        "import path to a class with the same interface (for experiments and tests).",
        default="elastic",
    )
    sources: list[Any] | None = _help(
        "Instead of data.name: a corpus of shard files or a user's stream, several mixed by weight, e.g. "
        "[{path: 'corpus/*.bin', format: tokens, weight: 0.7}, {path: 's3://bucket/web/*.jsonl', weight: 0.3}, "
        "{name: 'mymod:stream', params: {...}}]. Keys of a source: path and format (tokens, jsonl, parquet) or "
        "name and params (a factory returning an object with shards() and open(shard, offset)); weight (its share "
        "of every global batch, exact to within one sample over any number of steps); label; text_field (jsonl, "
        "parquet, streams of dicts: 'text'); dtype (.bin token files: uint16 or uint32); index (where its shard "
        "index is kept). Every source runs its own epochs, each sample exactly once per epoch, at any world size. "
        "The length of training is train.max_steps (train.epochs only with one source).",
        default=None,
    )
    pack: dict[str, Any] | None = _help(
        "With data.sources: {block_size: N}: documents tokenized with data.tokenizer, joined with an "
        "end-of-document token and cut into windows of N + 1 tokens, a pure function of their position; "
        "mask: documents leaves targets of the next document out of the loss (-100). Required for file sources.",
        default=None,
    )
    tokenizer: str = _help(
        "Tokenizer of data.pack: bytes (built in, no files: UTF-8 bytes 0..255, end of document 256, vocabulary "
        "257) or an import path to fn(text) -> list[int] with attributes vocab_size and eod (end-of-document id).",
        default="bytes",
    )

    def validate(self) -> None:
        if self.sources is not None:
            from .sources import check_sources

            if self.name != "digits":
                raise ConfigError("data.sources", f"is set together with data.name={self.name!r}",
                                  "Give the data either as data.name or as data.sources")
            check_sources(self.sources, self.pack, self.tokenizer)
            return
        if self.pack is not None:
            raise ConfigError("data.pack", "applies to data.sources", "Set data.sources, or remove data.pack")
        builtin = {"digits", "synthetic", "tokens", "image_folder", "cifar10", "fake_images"}
        if self.name not in builtin and not is_import_path(self.name):
            raise ConfigError(
                "data.name",
                f"unknown dataset {self.name!r}",
                f"Use one of {sorted(builtin)} or an import path like 'mypkg.data:build'",
            )
        if self.name in {"tokens", "image_folder", "cifar10"}:
            if not self.path:
                raise ConfigError(
                    "data.path", f"is required for data.name={self.name}",
                    "Set data.path to the dataset directory",
                )
            text = self.params.get("text") if self.name == "tokens" and isinstance(self.params, dict) else None
            if text is not None and not Path(str(text)).is_file():
                raise ConfigError("data.params.text", f"no such text file {text!r}",
                                  "Point data.params.text at a UTF-8 text file, e.g. examples/data/shakespeare.txt")
            if not Path(self.path).is_dir() and text is None:
                raise ConfigError(
                    "data.path", f"directory {self.path!r} does not exist",
                    f"Build the token files once with: elastic-runner data prepare-text TEXT.txt --out {self.path} "
                    "(or set data.params.text to the text file to prepare them on first use)"
                    if self.name == "tokens" else "Point data.path at an existing dataset directory",
                )
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(
                "data.test_fraction", f"got {self.test_fraction}, must be between 0 and 1",
                "Set data.test_fraction to e.g. 0.2",
            )
        if self.num_workers < 0:
            raise ConfigError(
                "data.num_workers", f"got {self.num_workers}, must be >= 0",
                "Set data.num_workers to 0 (load in the training process) or a positive count",
            )
        if self.eval_batch_size <= 0:
            raise ConfigError(
                "data.eval_batch_size", f"got {self.eval_batch_size}, must be positive",
                "Set data.eval_batch_size to e.g. 256",
            )
        if self.sampler != "elastic" and not is_import_path(self.sampler):
            raise ConfigError(
                "data.sampler", f"got {self.sampler!r}",
                "Use 'elastic' or an import path like 'mypkg.sampling:MySampler'",
            )
        if self.collate is not None and not is_import_path(self.collate):
            raise ConfigError("data.collate", f"got {self.collate!r}, not an import path",
                              "Write it as 'package.module:function', or null for torch's default_collate")


#: Built-in per-sample losses (for (input, target) items); anything else is an import path.
BUILTIN_LOSSES = ("cross_entropy", "mse")
#: Built-in evaluation metrics; "auto" picks them from the task.
BUILTIN_METRICS = ("loss", "accuracy", "mse", "r2", "perplexity")


@dataclass
class ModelConfig:
    """The model (built-in or an import path) and the loss it is trained with."""

    name: str = _help(
        "Model: mlp, cnn, gpt (decoder-only transformer for the tokens dataset), or an import path "
        "such as 'torchvision.models:resnet18'.",
        default="cnn",
    )
    params: dict[str, Any] = _help(
        "Keyword arguments for the model constructor (mlp: hidden, depth, dropout; "
        "cnn: channels, hidden, dropout; gpt: n_layer, n_head, n_embd, block_size, dropout, bias).",
        default_factory=dict,
    )
    sync_batchnorm: bool = _help(
        "Convert BatchNorm layers to SyncBatchNorm: batch statistics over the whole global batch instead "
        "of each rank's share (needs CUDA devices).",
        default=False,
    )
    compile: bool = _help(
        "Compile the model's forward pass with torch.compile (static shapes: a resumed run runs the kernels of an "
        "uninterrupted one and ends bitwise identical). Snapshots hold the plain model (no '_orig_mod.' keys): they "
        "load compiled or not. Compiled code is cached per node, in a directory of this user's only "
        "(TORCHINDUCTOR_CACHE_DIR overrides it), so a restarted worker does not generate it again. May change "
        "between attempts of a run.",
        default=False,
    )
    loss: str = _help(
        "Training loss: cross_entropy or mse for (input, target) items, or an import path to "
        "fn(model, batch) returning per-sample losses [B], or (losses [B], weights [B]) for a "
        "weighted mean (e.g. token counts); the step optimises the exact mean over the global batch.",
        default="cross_entropy",
    )

    def validate(self) -> None:
        if self.name not in {"mlp", "cnn", "gpt"} and not is_import_path(self.name):
            raise ConfigError(
                "model.name", f"unknown model {self.name!r}",
                "Use mlp, cnn, gpt or an import path like 'torchvision.models:resnet18'",
            )
        if self.loss not in BUILTIN_LOSSES and not is_import_path(self.loss):
            raise ConfigError(
                "model.loss", f"got {self.loss!r}, expected one of {', '.join(BUILTIN_LOSSES)} or an import path",
                "Set model.loss to cross_entropy, mse, or 'package.module:fn' with fn(model, batch) -> losses [B]",
            )


@dataclass
class EvalConfig:
    """What an evaluation over the test set reports."""

    metrics: list[str] | str = _help(
        "Metrics of an evaluation, averaged exactly over the test set across ranks: auto (by task: "
        "classification: loss and accuracy; regression: loss and r2; language model: loss and "
        "perplexity; your own loss: loss) or a list of loss, accuracy, mse, r2, perplexity and import "
        "paths to fn(model, batch) -> {name: per-sample values [B]}.",
        default="auto",
    )

    def validate(self) -> None:
        if isinstance(self.metrics, str):
            if self.metrics != "auto":
                raise ConfigError("eval.metrics", f"got {self.metrics!r}", "Use auto, or a list such as [loss, accuracy]")
            return
        for name in self.metrics:
            if name not in BUILTIN_METRICS and not is_import_path(name):
                raise ConfigError(
                    "eval.metrics", f"unknown metric {name!r}",
                    f"Use {', '.join(BUILTIN_METRICS)} or an import path 'package.module:fn'",
                )


@dataclass
class OptimConfig:
    """The optimizer, and gradient clipping."""

    name: str = _help(
        "Optimizer: sgd, adamw, or an import path to a torch.optim.Optimizer subclass.",
        default="sgd",
    )
    lr: float = _help("Learning rate (peak rate when a warm-up schedule is used).", default=0.1)
    momentum: float = _help("SGD momentum.", default=0.9)
    weight_decay: float = _help("Weight decay.", default=0.0)
    params: dict[str, Any] = _help(
        "Extra keyword arguments for the optimizer (e.g. betas for adamw).",
        default_factory=dict,
    )
    grad_clip_norm: float | None = _help(
        "Clip the global gradient norm to this value before each step (null: off).",
        default=None,
    )

    def validate(self) -> None:
        if self.name not in {"sgd", "adamw"} and not is_import_path(self.name):
            raise ConfigError(
                "optim.name", f"unknown optimizer {self.name!r}",
                "Use sgd, adamw or an import path like 'torch.optim:RMSprop'",
            )
        if not self.lr > 0:
            raise ConfigError("optim.lr", f"got {self.lr}, must be positive", "Set optim.lr to e.g. 0.1")
        if self.momentum < 0:
            raise ConfigError("optim.momentum", f"got {self.momentum}, must be >= 0", "Set optim.momentum to e.g. 0.9")
        if self.weight_decay < 0:
            raise ConfigError(
                "optim.weight_decay", f"got {self.weight_decay}, must be >= 0", "Set optim.weight_decay to e.g. 0.0001"
            )
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ConfigError(
                "optim.grad_clip_norm", f"got {self.grad_clip_norm}, must be positive",
                "Set optim.grad_clip_norm to e.g. 1.0, or null to disable clipping",
            )


@dataclass
class ScheduleConfig:
    """The learning-rate schedule."""

    name: str = _help(
        "Learning-rate schedule: constant, step, cosine, or an import path to a callable "
        "(optimizer, total_steps, **params) -> LRScheduler.",
        default="constant",
    )
    warmup_steps: int = _help("Linear warm-up from 0 over this many steps.", default=0)
    step_size: int = _help("step: multiply the rate by gamma every step_size steps.", default=100)
    gamma: float = _help("step: decay factor.", default=0.1)
    min_lr_ratio: float = _help("cosine: final rate as a fraction of optim.lr.", default=0.0)
    params: dict[str, Any] = _help("Extra keyword arguments for an import-path schedule.", default_factory=dict)

    def validate(self) -> None:
        if self.name not in {"constant", "step", "cosine"} and not is_import_path(self.name):
            raise ConfigError(
                "schedule.name", f"unknown schedule {self.name!r}",
                "Use constant, step, cosine or an import path like 'mypkg.sched:build'",
            )
        if self.warmup_steps < 0:
            raise ConfigError("schedule.warmup_steps", f"got {self.warmup_steps}, must be >= 0", "Set it to 0 for no warm-up")
        if self.step_size <= 0:
            raise ConfigError("schedule.step_size", f"got {self.step_size}, must be positive", "Set schedule.step_size to e.g. 100")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("schedule.min_lr_ratio", f"got {self.min_lr_ratio}, must be in [0, 1]", "Set it to e.g. 0.0")


@dataclass
class BatchConfig:
    """The optimisation contract: the global batch, and how it splits over ranks and micro-batches."""

    global_size: int | None = _help(
        "Samples per optimizer step across all ranks. Kept constant when the world size "
        "changes: each rank takes its share and the loss is normalised by this size, so "
        "the gradient does not depend on the world size.",
        default=64,
    )
    per_rank_size: int | None = _help(
        "Alternative policy: samples per rank per step (the global batch then grows with "
        "the world size). Set global_size to null to use it.",
        default=None,
    )
    micro_size: int | None = _help(
        "Largest micro-batch one rank processes at once (memory bound). A larger share is "
        "split into gradient-accumulation micro-steps. null: no limit.",
        default=None,
    )
    scale_lr: Literal["none", "linear"] = _help(
        "With per_rank_size: 'linear' multiplies optim.lr by the world size "
        "(optim.lr is then the rate for one rank).",
        default="none",
    )
    uneven: Literal["weighted", "refuse"] = _help(
        "When the world size does not divide global_size: 'weighted' lets shares differ by "
        "one sample (the gradient is still the exact global mean); 'refuse' stops with the "
        "list of world sizes that divide it (use with batch-norm models).",
        default="weighted",
    )

    def validate(self) -> None:
        if (self.global_size is None) == (self.per_rank_size is None):
            raise ConfigError(
                "batch", "exactly one of batch.global_size and batch.per_rank_size must be set",
                "Set batch.global_size (constant optimisation, recommended) and batch.per_rank_size: null, or the reverse",
            )
        for key in ("global_size", "per_rank_size", "micro_size"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(
                    f"batch.{key}", f"got {value}, must be a positive integer",
                    f"Set batch.{key} to e.g. 64" + (" or null" if key != "global_size" else ""),
                )
        if self.scale_lr == "linear" and self.per_rank_size is None:
            raise ConfigError(
                "batch.scale_lr", "'linear' only applies with batch.per_rank_size",
                "Set batch.scale_lr: none, or use batch.per_rank_size",
            )


@dataclass
class TrainConfig:
    """How long to train, evaluation cadence, precision and what to do with a non-finite gradient."""

    max_steps: int | None = _help("Stop after this many optimizer steps (counted from 1).", default=None)
    epochs: int | None = _help("Stop after this many epochs. With max_steps, whichever comes first.", default=None)
    eval_every_steps: int = _help("Evaluate on the test split every N steps (0: only at the end).", default=0)
    precision: Literal["fp32", "bf16", "fp16"] = _help(
        "Autocast dtype for forward passes. fp16 needs a GPU and uses a gradient scaler "
        "(saved in snapshots); bf16 works on CPU and recent GPUs.",
        default="fp32",
    )
    on_nonfinite: Literal["stop", "skip", "rollback"] = _help(
        "A step whose gradient is not finite (the loss is NaN or inf on some rank): stop (one line "
        "naming the step and the rank, exit status 3, which is not restarted; the snapshots stay as "
        "they were; noted on the device and read at the next logging step, so a step never waits for a GPU "
        "for it, and no snapshot is taken after the step that diverged), skip (no update on any rank; counted "
        "in elastic_runner_nonfinite_steps_total; decided before the update: free with a fused optimizer, "
        "optim.params: {fused: true} for sgd or adamw, which skips on the device, else one read of the device per "
        "step) or rollback (noted and read as for stop; then every worker, in its process, resumes from the newest "
        "snapshot, necessarily from before that step (node memory first), and skips that step by rule: its batch "
        "is consumed, no update is made, its samples are marked skipped in the audit trail; the rule travels in "
        "every later snapshot, as train.skip_steps would. recovery.max_rollbacks in "
        "recovery.rollback_window_seconds, then exit status 3). "
        "With fp16 the gradient scaler skips such steps itself.",
        default="stop",
    )
    skip_steps: list[int] = _help(
        "Steps whose batch is consumed but not trained on (no forward pass, no update; the learning-rate schedule "
        "advances): e.g. the steps around a loss spike, after resuming from a snapshot before it. Their samples are "
        "marked skipped in the audit trail (each still used once: never seen twice, never lost unsaid). "
        "train.on_nonfinite: rollback adds to this list by itself.",
        default_factory=list,
    )

    def validate(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ConfigError(
                "train", "neither train.max_steps nor train.epochs is set",
                "Set train.epochs (e.g. 10) and/or train.max_steps (e.g. 1000)",
            )
        for key in ("max_steps", "epochs"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"train.{key}", f"got {value}, must be a positive integer", f"Set train.{key} to e.g. 10, or null")
        bad = [s for s in self.skip_steps if isinstance(s, bool) or not isinstance(s, int) or s <= 0]
        if bad:
            raise ConfigError("train.skip_steps", f"got {bad[0]!r} in {self.skip_steps!r}, each must be a step number "
                              ">= 1", "Write the steps as a list of integers, e.g. [1200, 1201]")
        if self.eval_every_steps < 0:
            raise ConfigError("train.eval_every_steps", f"got {self.eval_every_steps}, must be >= 0", "Set it to 0 to evaluate only at the end")
