"""Training throughput and peak memory of a head on the embedded target; prints one JSON line
(with preset=specforge: one per document profile and padding mode, see below).

    python scripts/bench_train.py [+head=eagle3|medusa] [--labelled F] [key=value ...]
    (any root-config override, e.g. head.ttt_length=3, or head.joint=true head.lora_rank=16)

Batches are real: chat-templated conversations from `data.source` (ShareGPT by default) through
the real target, captured as training will see them (fp32 on CPU, bf16 autocast on a GPU), at
`optim.batch_tokens` tokens per batch. The last fraction F (default 1.0, the worst case) of each
row is labelled, as an answer after its prompt: the vocabulary projections, and EAGLE-3's later
unroll steps, scale with the labelled tokens. EAGLE-3 is the default head. After the timed steps,
two more are timed by parts (`StepBreakdown`): `breakdown_s` holds the mean seconds per step of
fc, attention, mlp, lm_head, teacher, the rest of the forward, backward and optimizer (these add
up to a step), and ttt_unroll (the forward's later unroll steps, inside the parts).

    python scripts/bench_train.py preset=specforge [tiny=true] [docs=equal,spread,lognormal] \
        [padding=padded,packed] [warmup=5] [steps=20] [--labelled 0.75] [head.* / optim.* ...]

`preset=specforge` measures what SpecForge's EAGLE-3 sequence-packing benchmark measures
(docs/benchmarks/eagle3-sequence-packing.md, one H200, 2026-10-02), at its shapes, so that the
figures compare: one draft step (forward, backward, optimizer update, the frozen target lm_head's
teacher projection included: SpecForge's over the whole vocabulary, ours over the draft vocabulary's
rows, the target's top-1 coming with the features as capture keeps it) on target features already
on the device. The target is random, of
Llama-3.2-1B's shape (hidden 2048, 16 layers, vocabulary 128256; only its config, embeddings and
lm_head exist: the features are random too). The draft: hidden 2048, intermediate 8192, 16 heads /
4 KV heads (head_dim 128), draft vocabulary 32000, TTT 7, bf16 autocast on a GPU; micro-batches
of 4 documents, 25% of each a prompt (unlabelled). Each `docs` profile, in each `padding` mode,
prints ONE JSON line: useful (non-pad) tokens/s over the mean synchronised step, step_ms (mean
and p50), peak_mem_mib (CUDA memory allocated: model, optimizer state and inputs included; on a
CPU the process's peak RSS). `tiny=true` keeps the code path at toy sizes (a CPU, CI: seconds).
"""

from __future__ import annotations

import json
import re
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from conf.compose import compose_root, split_args
from conf.errors import UserError, exit_on_user_error
from conf.schema import DataConfig, OptimConfig, RootConfig, derive
from conf.usage import answer_help
from data_prep.conversations.sources import iter_samples
from data_prep.prepare import capture_spec, draft_vocab_size
from data_prep.states.capture import TOP, greedy_ids
from data_prep.stats import PrepStats
from data_prep.target import resolve_target
from heads.eagle3.model import Eagle3Head, draft_layer_config
from heads.folder import TargetSpec
from heads.kinds import HeadKind, head_kind
from trainer.batching import best_fit_rows, collate, collate_packed
from trainer.distributed import mixed_precision
from trainer.kinds import build_trainee
from trainer.kinds.eagle3 import Eagle3Trainee
from trainer.loop import adamw
from trainer.trainee import Batch, BatchIndex


def real_tokens(
    tok, data_cfg: DataConfig, rows: int, seq_len: int, labelled: float
) -> dict[str, torch.Tensor]:
    """`rows` chat-templated conversations of `data_cfg.source` cut to `seq_len` tokens (CPU
    `input_ids`, `loss_mask`), the last `labelled` fraction of each row labelled."""
    texts = []
    # the source's answers as they are: enough for timing
    for sample in iter_samples(derive(data_cfg, {"regenerate.enabled": False}), PrepStats()):
        ids = tok.apply_chat_template(sample.messages, tokenize=True, return_dict=True)["input_ids"]
        if len(ids) >= seq_len:
            texts.append(ids[:seq_len])
        if len(texts) == rows:
            break
    ids = torch.tensor(texts)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, : round(seq_len * (1 - labelled))] = False
    return {"input_ids": ids, "loss_mask": mask}


def lowest_draft_vocab(vocab: int, draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft vocabulary of the `draft` lowest target ids: what a step costs
    depends on the sizes only."""
    d2t = torch.zeros(draft, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    return d2t, t2d


def bench_trainee(cfg: RootConfig, model, kind: HeadKind) -> tuple[torch.nn.Module, dict]:
    """A fresh trainee of the configured kind as training builds it, without a data folder (a
    draft vocabulary, if the kind has one, of the lowest ids), and the fields the line names.
    Only the labelled fraction trains (`--labelled`), whatever the kind's default prompt weight."""
    fields = {name: getattr(cfg.head, name) for name in kind.bench_fields}
    draft = draft_vocab_size(cfg, kind, model.config.vocab_size)
    if draft is not None:
        fields["draft_vocab_size"] = draft
    return build_trainee(derive(cfg, {"head.prompt_loss_weight": 0.0}), model, None), fields


def parse(argv: list[str], labelled: float = 1.0) -> tuple[RootConfig, float]:
    """(config, labelled fraction) from `[--labelled F] [+head=...] [key=value ...]`; EAGLE-3
    unless a head is named."""
    if "--labelled" in argv:
        i = argv.index("--labelled")
        labelled, argv = float(argv[i + 1]), argv[:i] + argv[i + 2 :]
    if not any(a.startswith("+head=") for a in argv):
        argv = ["+head=eagle3", *argv]
    return compose_root(argv), labelled


def batch_shape(cfg: RootConfig) -> tuple[int, int]:
    """(rows, seq_len) of one `optim.batch_tokens` batch, rows of at most 512 tokens."""
    seq_len = min(512, cfg.optim.batch_tokens)
    return max(1, cfg.optim.batch_tokens // seq_len), seq_len


def no_mark(phase: str) -> None:
    """`make_step`'s default phase marker: nothing (the throughput runs)."""


def make_step(
    trainee, optim: OptimConfig, device: torch.device, bf16: bool
) -> tuple[Callable[..., None], int]:
    """A training step on a device batch as the loop runs it (bf16 autocast as accelerate applies
    `dist.mixed_precision`, the trainee's AdamW groups, gradient clipping), and how many
    parameters it trains. `step(batch, mark)` calls `mark` with each phase as it begins
    ("forward", "backward", "optimizer") and with "end" (`StepBreakdown` times them)."""
    groups = trainee.param_groups(optim.lr, optim.weight_decay)
    params = [p for g in groups for p in g["params"]]
    opt = adamw(groups, optim)

    def step(batch: Batch, mark: Callable[[str], None] = no_mark) -> None:
        mark("forward")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = trainee(batch)["loss"]
        mark("backward")
        loss.backward()
        mark("optimizer")
        torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        opt.zero_grad()
        mark("end")

    return step, sum(p.numel() for p in params)


# The forward's parts `StepBreakdown` charges module calls to, by what the module computes. A
# module inside one already charged is part of it (an attention's projections are attention).
FORWARD_PARTS = ("fc", "attention", "mlp", "lm_head", "teacher")


def module_part(name: str, module: torch.nn.Module) -> str | None:
    """The part of the forward a module's calls are charged to, None for the rest: the fusing
    `fc`, attention and MLP blocks (a draft layer's, Medusa's residual blocks, a trained
    target's), and the vocabulary projections (`lm_head`, Medusa's `lm_heads.k`)."""
    cls, leaf = type(module).__name__, name.rsplit(".", 1)[-1]
    if leaf == "fc" and isinstance(module, torch.nn.Linear):
        return "fc"
    if cls.endswith("Attention"):
        return "attention"
    if cls.endswith(("MLP", "Block")):
        return "mlp"
    if re.search(r"(^|\.)(lm_head|lm_heads\.\d+)$", name):
        return "lm_head"
    return None


class StepBreakdown:
    """Where a training step's time goes, by timed sections: the wall clock at each phase of
    `make_step` (forward, backward, optimizer: clipping, AdamW and zeroing the gradients) and,
    inside the forward, at the entry and exit of each module `module_part` names (forward hooks,
    the outermost charged call counts) and of the trainee's `teacher` where it has one. What the
    forward spends elsewhere (embeddings, rotary, norms, masks, gathers, log-softmax and the
    objective) is `forward_other`. Calls made while autograd recomputes a checkpointed forward
    belong to the backward. `ttt_unroll` is the forward from the second call of the decoder
    layer (step k=1 of EAGLE-3's training-time-test unroll) to its end: what the later unroll
    steps add (inside the parts above, not beside them; 0 without an unroll). On a GPU each
    timestamp synchronises first, which serialises the step: the breakdown then runs slower
    than the throughput steps, which are timed without it."""

    def __init__(self, trainee: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: Counter = Counter()
        self.steps, self.phase, self.started = 0, None, 0.0
        self.depth, self.entered = 0, 0.0
        self.layer_calls: Counter = Counter()
        self.unroll_from: float | None = None
        self.trainee, self.handles = trainee, []
        for name, module in trainee.named_modules():
            if part := module_part(name, module):
                self.handles += [
                    module.register_forward_pre_hook(lambda *_: self._enter()),
                    module.register_forward_hook(lambda *_, part=part: self._leave(part)),
                ]
            elif type(module).__name__.endswith("DecoderLayer"):
                self.handles.append(module.register_forward_pre_hook(lambda m, _: self._layer(m)))
        if hasattr(trainee, "teacher"):
            self._wrap_teacher(trainee)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self) -> None:
        if self.phase == "forward":
            if self.depth == 0:
                self.entered = self._now()
            self.depth += 1

    def _leave(self, part: str) -> None:
        if self.phase == "forward":
            self.depth -= 1
            if self.depth == 0:
                self.seconds[part] += self._now() - self.entered

    def _layer(self, layer: torch.nn.Module) -> None:
        """A decoder layer's call: its second in one forward starts the unroll's later steps (a
        trained target's layers run once each)."""
        if self.phase == "forward":
            self.layer_calls[id(layer)] += 1
            if self.layer_calls[id(layer)] == 2 and self.unroll_from is None:
                self.unroll_from = self._now()

    def _wrap_teacher(self, trainee) -> None:
        teacher = trainee.teacher

        def timed(*args, **kwargs):
            self._enter()
            out = teacher(*args, **kwargs)
            self._leave("teacher")
            return out

        trainee.teacher = timed

    def mark(self, phase: str) -> None:
        """`make_step`'s marker: close the running phase, open `phase`."""
        now = self._now()
        if self.phase is not None:
            self.seconds[self.phase] += now - self.started
        if self.phase == "forward" and self.unroll_from is not None:
            self.seconds["ttt_unroll"] += now - self.unroll_from
        if phase == "end":
            self.steps += 1
        self.phase, self.started = (None if phase == "end" else phase), now
        self.layer_calls.clear()
        self.unroll_from = None

    def record(self) -> dict[str, float]:
        """Mean seconds per step of each part: the forward's parts, `forward_other`, `backward`
        and `optimizer` add up to the step; `ttt_unroll` lies inside the forward."""
        per = {k: v / max(self.steps, 1) for k, v in self.seconds.items()}
        parts = {k: per.get(k, 0.0) for k in FORWARD_PARTS}
        parts["forward_other"] = per.get("forward", 0.0) - sum(parts.values())
        parts |= {k: per.get(k, 0.0) for k in ("backward", "optimizer", "ttt_unroll")}
        return {k: round(v, 6) for k, v in parts.items()}

    def close(self) -> None:
        """Remove the hooks and the teacher's wrapper: the trainee is as it was."""
        for handle in self.handles:
            handle.remove()
        self.trainee.__dict__.pop("teacher", None)


def step_breakdown(
    trainee, step: Callable[..., None], batch: Batch, device: torch.device, steps: int
) -> dict[str, float]:
    """`StepBreakdown.record` over `steps` more steps on `batch`, after the timed ones."""
    breakdown = StepBreakdown(trainee, device)
    try:
        for _ in range(steps):
            step(batch, breakdown.mark)
    finally:
        breakdown.close()
    return breakdown.record()


def timed_steps(
    run: Callable[[int], None], device: torch.device, warmup: int, steps: int
) -> tuple[list[float], float]:
    """Seconds of each of `steps` calls run(i) after `warmup` untimed ones, and the peak memory in
    MiB. On a GPU each timed call is synchronised before and after, so that it is charged its own
    kernels and no other's; the peak is the CUDA memory allocated during the timed calls (model,
    optimizer state and inputs included). On a CPU it is the process's peak resident set."""
    for i in range(warmup):
        run(i)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        run(i)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    if cuda:
        return seconds, torch.cuda.max_memory_allocated() / 2**20
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def precision(bf16: bool) -> str:
    return "bf16-autocast" if bf16 else "fp32"


# ---- preset=specforge ---------------------------------------------------------------------------
MICRO_BATCH = 4  # documents per micro-batch, as SpecForge's benchmark
SPECFORGE_SEED = 1729  # SpecForge's; here it draws the documents (lengths, ids) of both modes


@dataclass(frozen=True)
class Preset:
    target: dict  # LlamaConfig fields of the random target
    head: dict  # head.* overrides: the draft layer
    draft_vocab: int
    row_len: int  # tokens per row; a longer document (docs=spread) widens its micro-batch's rows


LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
PRESETS = {  # by (preset, tiny)
    ("specforge", False): Preset(
        LLAMA_3_2_1B,
        {"intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 4, "ttt_length": 7},
        draft_vocab=32000,
        row_len=1024,
    ),
    # The same code path at toy sizes (8 target layers: three distinct default aux layers).
    ("specforge", True): Preset(
        {
            **LLAMA_3_2_1B,
            **dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8),
            **dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=2048),
        },
        {"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1, "ttt_length": 7},
        draft_vocab=512,
        row_len=128,
    ),
}


def lognormal_lengths(row_len: int, g: torch.Generator) -> list[int]:
    """Chat-like document lengths: log-normal, median 3/8 of a row, sigma 0.8, clipped to
    [row_len/32, row_len]: a mean of ~0.45 row, ~42% padding when 4 are padded to the longest
    and ~20% when they are packed into rows (both over many micro-batches)."""
    draws = (torch.randn(MICRO_BATCH, generator=g) * 0.8).exp() * (row_len * 3 / 8)
    return draws.round().clamp(row_len // 32, row_len).int().tolist()


# Each micro-batch's document lengths. equal and spread are the profiles of SpecForge's table
# (4 x 1024: 46,643 -> 53,419 useful tokens/s padded -> packed; 512/768/1024/2048: 29,515 ->
# 42,554); lognormal draws fresh lengths for every micro-batch.
DOCS: dict[str, Callable[[int, torch.Generator], list[int]]] = {
    "equal": lambda row_len, g: [row_len] * MICRO_BATCH,
    "spread": lambda row_len, g: [row_len // 2, row_len * 3 // 4, row_len, 2 * row_len],
    "lognormal": lognormal_lengths,
}


def padded_rows(samples: list[Batch], row_len: int, index: BatchIndex) -> Batch:
    """One document per row, right-padded to the longest: the loader's own collate."""
    return collate(samples, index)


def packed_rows(samples: list[Batch], row_len: int, index: BatchIndex) -> Batch:
    """The same documents packed best-fit into rows of `row_len`, as `optim.packing` packs a
    window of samples (each attends to and is predicted from its own document only)."""
    rows = best_fit_rows([len(s["input_ids"]) for s in samples], list(range(len(samples))), row_len)
    return collate_packed([[samples[i] for i in row] for row in rows], index)


PADDING: dict[str, Callable[[list[Batch], int, BatchIndex], Batch]] = {
    "padded": padded_rows,
    "packed": packed_rows,
}


def synthetic_document(length: int, vocab: int, labelled: float, g: torch.Generator) -> Batch:
    """A document as the captured data set gives one, without its features (the bench adds them
    on the device): random ids, the first 1 - `labelled` of it a prompt."""
    mask = torch.ones(length, dtype=torch.bool)
    mask[: round(length * (1 - labelled))] = False
    return {"input_ids": torch.randint(vocab, (length,), generator=g), "loss_mask": mask}


def preset_batches(
    preset: Preset, docs: str, padding: str, count: int, labelled: float, trainee, device
) -> list[Batch]:
    """`count` device micro-batches of `docs` documents laid out by `padding`; the same documents
    for every mode. The target features (and its top-1 ids, which capture keeps) are views of one
    random device tensor each (float32, as the loop widens them): already on the device, and no
    more memory than the widest batch needs."""
    g = torch.Generator().manual_seed(SPECFORGE_SEED)
    cpu = []
    for _ in range(count):
        lengths = DOCS[docs](preset.row_len, g)
        samples = [synthetic_document(n, preset.target["vocab_size"], labelled, g) for n in lengths]
        cpu.append(PADDING[padding](samples, max(preset.row_len, *lengths), trainee.batch_index))
    slots = max(b["input_ids"].numel() for b in cpu)
    hidden, vocab = preset.target["hidden_size"], preset.target["vocab_size"]
    features = {
        "aux_hidden": torch.randn(slots, trainee.head.fc.in_features, device=device),
        "final_hidden": torch.randn(slots, hidden, device=device),
        TOP: torch.randint(vocab, (slots,), generator=g).int().to(device),
    }
    out = []
    for b in cpu:
        rows, cols = b["input_ids"].shape
        n = rows * cols
        out.append(
            {k: v.to(device) for k, v in b.items()}
            | {k: v[:n].view(rows, cols, *v.shape[1:]) for k, v in features.items()}
        )
    return out


def preset_trainee(cfg: RootConfig, preset: Preset, device: torch.device) -> Eagle3Trainee:
    """A fresh draft for a random target of `preset.target`'s shape, built on `device`. Only what
    a step reads exists: the target's config and lm_head, the draft's embeddings (frozen), all
    random: values do not change what a step costs."""
    target = LlamaConfig(**preset.target)
    config = draft_layer_config(target, cfg.head, cfg.data.draft_vocab_size)
    # SpecForge's draft config names no head_dim: hidden / heads (128), not the target's 64.
    config.head_dim = config.hidden_size // config.num_attention_heads
    spec = TargetSpec("random", target.vocab_size, target.hidden_size, target.num_hidden_layers)
    with torch.device(device):
        head = Eagle3Head(config, spec)
        target_lm_head = torch.randn(target.vocab_size, target.hidden_size) * 0.02
    head.set_vocab(*lowest_draft_vocab(target.vocab_size, config.draft_vocab_size))
    return Eagle3Trainee(head, target_lm_head, cfg.head.ttt_length, cfg.head.step_weight)


# Steps `step_breakdown` times by parts, after (and apart from) the throughput's steps.
BREAKDOWN_STEPS = 2
PRESET_KEYS = ("preset", "tiny", "docs", "padding", "warmup", "steps")


def _choices(own: dict[str, str], key: str, known: dict) -> list[str]:
    picked = own.get(key, ",".join(known)).split(",")
    if unknown := [p for p in picked if p not in known]:
        raise UserError(f"{key}={own[key]}: {', '.join(unknown)} unknown (choose from {', '.join(known)})")
    return picked


def run_preset(own: dict[str, str], argv: list[str]) -> None:
    """preset=specforge: one JSON line per (docs, padding)."""
    name, tiny = own["preset"], own.get("tiny", "false") == "true"
    if (name, tiny) not in PRESETS:
        raise UserError(f"preset={name}: expected specforge")
    if any(a.startswith("+head=") and a != "+head=eagle3" for a in argv):
        raise UserError("preset=specforge trains an EAGLE-3 draft: drop +head=")
    preset = PRESETS[name, tiny]
    docs, modes = _choices(own, "docs", DOCS), _choices(own, "padding", PADDING)
    warmup, steps = int(own.get("warmup", 1 if tiny else 5)), int(own.get("steps", 2 if tiny else 20))
    if warmup < 0 or steps < 1:
        raise UserError(f"warmup={warmup} steps={steps}: expected warmup >= 0 and steps >= 1")
    defaults = [f"head.{k}={v}" for k, v in preset.head.items()]
    cfg, labelled = parse([*defaults, f"data.draft_vocab_size={preset.draft_vocab}", *argv], 0.75)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = mixed_precision(cfg.dist) == "bf16"
    trainee = preset_trainee(cfg, preset, device)
    step, trainable = make_step(trainee, cfg.optim, device, bf16)
    c = trainee.head.config
    draft = {
        k: getattr(c, k)
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    } | {"head_dim": c.head_dim, "draft_vocab_size": c.draft_vocab_size, "ttt_length": cfg.head.ttt_length}
    for profile in docs:
        for mode in modes:
            batches = preset_batches(preset, profile, mode, warmup + steps, labelled, trainee, device)
            seconds, peak = timed_steps(lambda i, b=batches: step(b[i]), device, warmup, steps)
            timed = batches[warmup:]
            useful = sum(int(b["attention_mask"].sum()) for b in timed)
            slots = sum(b["input_ids"].numel() for b in timed)
            record = {
                "preset": name,
                "tiny": tiny,
                "docs": profile,
                "padding": mode,
                "device": str(device),
                "precision": precision(bf16),
                "threads": torch.get_num_threads(),
                "target": {k: preset.target[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
                "draft": draft,
                "trainable_params": trainable,
                "labelled": labelled,
                "batch_shapes": sorted({tuple(b["input_ids"].shape) for b in timed}),
                "padding_share": round(1 - useful / slots, 4),
                "warmup": warmup,
                "steps": steps,
                "useful_tokens_per_step": useful / steps,
                "useful_tokens_per_s": round(useful / sum(seconds), 1),
                "step_ms": round(1000 * statistics.mean(seconds), 2),
                "step_ms_p50": round(1000 * statistics.median(seconds), 2),
                "peak_mem_mib": round(peak, 1),
            }
            print(json.dumps(record), flush=True)


@exit_on_user_error
def main(argv: list[str]) -> None:
    answer_help(__doc__, argv)
    own, argv = split_args(argv, PRESET_KEYS)
    if "preset" in own:
        return run_preset(own, argv)
    cfg, labelled = parse(argv)
    target = resolve_target(cfg)
    model = target.model
    batch = real_tokens(target.tokenizer, cfg.data, *batch_shape(cfg), labelled)
    batch = {k: v.to(model.device) for k, v in batch.items()}
    kind = head_kind(cfg.head.name)
    trainee, fields = bench_trainee(cfg, model, kind)
    with torch.no_grad():  # captured as training will see them (Medusa-2 reads none)
        hs = model(batch["input_ids"], output_hidden_states=True).hidden_states
    spec = capture_spec(cfg, kind, model.config.get_text_config().num_hidden_layers)
    if spec.aux_layer_ids:
        batch["aux_hidden"] = torch.cat([hs[i] for i in spec.aux_layer_ids], -1).float()
    batch["final_hidden"] = hs[-1].float()
    if spec.target_top:
        batch[TOP] = greedy_ids(model.get_output_embeddings(), batch["final_hidden"].bfloat16().float())
    trainee.to(model.device)
    batch |= trainee.batch_index(batch)  # what the loader adds on the CPU; here once, untimed
    use_bf16 = mixed_precision(cfg.dist) == "bf16"
    step, trainable = make_step(trainee, cfg.optim, model.device, use_bf16)
    n = 5
    seconds, peak = timed_steps(lambda _: step(batch), model.device, 1, n)
    breakdown = step_breakdown(trainee, step, batch, model.device, BREAKDOWN_STEPS)
    elapsed = sum(seconds)
    tokens, labels = batch["input_ids"].numel(), int(batch["loss_mask"].sum())
    print(
        json.dumps(
            {
                "head": cfg.head.name,
                "target": cfg.target.name_or_path,
                "device": str(model.device),
                "precision": precision(use_bf16),
                "threads": torch.get_num_threads(),
                **fields,
                "trainable_params": trainable,
                "batch_shape": list(batch["input_ids"].shape),
                "labelled_tokens": labels,
                "train_tokens_per_s": round(n * tokens / elapsed, 1),
                "labelled_tokens_per_s": round(n * labels / elapsed, 1),
                "step_s": round(elapsed / n, 3),
                "peak_memory_mib": round(peak, 1),
                "breakdown_steps": BREAKDOWN_STEPS,
                "breakdown_s": breakdown,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
