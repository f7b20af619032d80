"""How Medusa heads learn: Medusa-1 on a frozen target's captured final hidden states, Medusa-2
jointly with the target (full fine-tune or LoRA) from token ids.

Both are trainees of the one loop in `trainer/loop.py`. A cross-entropy over the full target
vocabulary keeps its logits for backward up to `KEEP_LOGITS_BYTES` per call; beyond that it runs
in row chunks under activation checkpointing (only the hidden rows are kept and each chunk's
logits are recomputed in backward, ~40% more time), so a 4k-token batch never holds
num_heads x tokens x vocab logits (3 GiB for SmolLM2) at once.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conf.errors import UserError
from conf.files import staged_dir
from conf.kinds import MedusaConfig
from data_prep.states.capture import document_inputs
from heads.medusa.model import TARGET_DIR, MedusaHead, write_target_checksums
from trainer.decoding import MedusaDrafter
from trainer.decoding.drafters import Shape
from trainer.objective import CROSS_ENTROPY, Objective, weighted_mean
from trainer.trainee import (
    FP32,
    LABEL_INDEX,
    LABEL_POSITION,
    RowSizes,
    indexed,
    label_batch_index,
    shift_left,
    simulated_acceptance_length,
    strip_prefix,
    trained_mask,
)

LOSS_CHUNK = 1024  # rows per logits chunk: 1024 x 49152 float32 = 192 MiB
KEEP_LOGITS_BYTES = 512 * 2**20  # per call; 2730 rows of SmolLM2's vocabulary


def offset_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels for predicting `offset` tokens ahead: position t gets input_ids[t+offset] and is
    trained only where loss_mask[t+offset] (an assistant token). Offset 1 is the target's own
    next-token prediction; Medusa head k uses offset k+2."""
    return shift_left(input_ids, offset, 0), shift_left(loss_mask, offset, False)


def offset_rows(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    labelled: torch.Tensor,
    offset: int,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, targets, counted) [N] for predicting `offset` tokens ahead at the N labelled
    positions `labelled` (a batch's `label_index`, at `positions` in their own samples): flat
    row u-offset predicts the token at u. The rows of labels too close to their sample's start
    are kept, clamped into range, and not `counted` (in a packed row they would be another
    sample's), so that N, a shape the host knows, is every head's row count."""
    ids, trained = offset_labels(input_ids, loss_mask, offset)
    rows = (labelled - offset).clamp(min=0)
    counted = trained.flatten().index_select(0, rows) & (positions >= offset)
    return rows, ids.flatten().index_select(0, rows), counted


def _chunk_rows(
    project: nn.Module,
    teacher_project: nn.Module | None,
    count_hits: bool,
    objective: Objective,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, top-1 hit, top-5 hit) per row of one chunk.

    The loss is the `objective`'s to `labels`, or with a teacher KL(teacher || student), the
    self-distillation term whose minimum keeps the student's distribution where the teacher's
    was; hits are then counted against the teacher's argmax (agreement) instead of the labels."""
    logp = F.log_softmax(project(hidden).float(), dim=-1)
    if teacher_hidden is None:
        row_loss = objective.hard(logp, labels)
        reference = labels
    else:
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher_project(teacher_hidden).float(), dim=-1)
        row_loss = (teacher_logp.exp() * (teacher_logp - logp)).sum(-1)
        reference = teacher_logp.argmax(-1)
    if not count_hits:
        none = torch.zeros_like(labels, dtype=torch.bool)
        return row_loss, none, none
    with torch.no_grad():
        hit = logp.topk(min(5, logp.shape[-1]), dim=-1).indices == reference[:, None]
        return row_loss, hit[:, 0], hit.any(-1)


def token_rows(
    project: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    teacher_project: nn.Module | None = None,
    teacher_hidden: torch.Tensor | None = None,
    chunk: int = LOSS_CHUNK,
    keep_bytes: int = KEEP_LOGITS_BYTES,
    objective: Objective = CROSS_ENTROPY,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss and top-1 / top-5 hits [N] of `project(hidden)` (a Linear) on the rows of [N, H].

    With gradients on (training), the logits stay for backward when N x vocab float32 fits in
    `keep_bytes`; otherwise each chunk of rows runs under checkpointing (logits recomputed in
    backward). Hits are not counted while training (all False): the top-k over the vocabulary
    would cost a fifth of a chunk, and only validation reads them. Without gradients, chunks
    bound the memory. An empty N still calls `project` once so that every parameter joins the
    graph, as DDP needs."""
    training = torch.is_grad_enabled()
    terms = partial(_chunk_rows, project, teacher_project, not training, objective)
    run = terms
    if training and hidden.shape[0] * project.weight.shape[0] * 4 <= keep_bytes:
        chunk = max(1, hidden.shape[0])
    elif training:
        run = partial(checkpoint, terms, use_reentrant=False)
    parts = []
    for start in range(0, max(1, hidden.shape[0]), chunk):
        part = slice(start, start + chunk)
        teacher_part = None if teacher_hidden is None else teacher_hidden[part]
        parts.append(run(hidden[part], labels[part], teacher_part))
    loss, top1, top5 = (torch.cat(column) for column in zip(*parts))
    return loss, top1, top5


def token_loss(
    project: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    teacher_project: nn.Module | None = None,
    teacher_hidden: torch.Tensor | None = None,
    chunk: int = LOSS_CHUNK,
    keep_bytes: int = KEEP_LOGITS_BYTES,
    counted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_rows` summed over the `counted` [N] rows (default all): loss and hit counts."""
    loss, top1, top5 = token_rows(project, hidden, labels, teacher_project, teacher_hidden, chunk, keep_bytes)
    if counted is None:
        counted = torch.ones_like(labels, dtype=torch.bool)
    return torch.where(counted, loss, 0).sum(), (top1 & counted).sum(), (top5 & counted).sum()


def head_losses(
    head: MedusaHead,
    final_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    head_weight: float,
    index: dict[str, torch.Tensor] | None = None,
    objective: Objective = CROSS_ENTROPY,
    trained: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_k head_weight**k * the `objective`'s weighted mean loss of head k over its labelled
    positions, and per-head sums over the answer positions (`loss_mask`) for validation
    (`head_ce`: the objective's loss, `head_top1`, `head_top5`, `head_total`, each
    [num_heads]; the hit counts are zeros when gradients are on, see `token_rows`).
    `trained`: the positions whose tokens train (`trained_mask`; None: `loss_mask`); `index`:
    their `label_batch_index` fields, or None to find them in one-sample rows here (a sync on a
    GPU)."""
    trained = loss_mask if trained is None else trained
    if index is None:
        index = label_batch_index({"input_ids": input_ids, "loss_mask": trained})
    labelled, positions = index[LABEL_INDEX], index[LABEL_POSITION]
    answer = loss_mask.flatten().index_select(0, labelled)
    weight = objective.row_weights(answer)
    hidden = final_hidden.flatten(0, 1)
    stats = final_hidden.new_zeros(4, head.num_heads)
    loss = final_hidden.new_zeros(())
    for k in range(head.num_heads):
        rows, targets, counted = offset_rows(input_ids, trained, labelled, 2 + k, positions)
        block_out = head.blocks[k](hidden.index_select(0, rows).to(head.lm_heads[k].weight.dtype))
        row_loss, top1, top5 = token_rows(head.lm_heads[k], block_out, targets, objective=objective)
        loss = loss + head_weight**k * weighted_mean(row_loss, torch.where(counted, weight, 0))
        scored = counted & answer
        ce = torch.where(scored, row_loss, 0).sum().detach()
        hits = [(top1 & scored).sum(), (top5 & scored).sum(), scored.sum()]
        stats[:, k] = torch.stack([ce, *(h.to(ce) for h in hits)])
    names = ("head_ce", "head_top1", "head_top5", "head_total")
    return loss, dict(zip(names, stats))


def summarize_heads(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-head loss (`ce_k`: the objective's, cross-entropy by default) / top-1 / top-5
    accuracy on the answers; `score` = the simulated acceptance length
    1 + sum_k prod_{j<=k} top1_j (heads assumed to hit independently, each given a correct
    prefix), the number of tokens one Medusa chain step would yield on average."""
    total = sums["head_total"].clamp(min=1)
    out: dict[str, float] = {}
    for name in ("ce", "top1", "top5"):
        for k, value in enumerate((sums[f"head_{name}"] / total).tolist()):
            out[f"{name}_{k}"] = value
    top1 = (sums["head_top1"] / total).tolist()
    out["sim_acceptance_length"] = simulated_acceptance_length(top1)
    out["score"] = out["sim_acceptance_length"]
    return out


class MedusaTrainee(nn.Module):
    """Medusa-1: trainable heads on the frozen target's captured final hidden states."""

    def __init__(self, head: MedusaHead, head_weight: float, objective: Objective = CROSS_ENTROPY):
        super().__init__()
        self.head, self.head_weight, self.objective = head, head_weight, objective
        self.batch_index = partial(label_batch_index, prompt_weight=objective.prompt_weight)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "final_hidden" not in batch:
            raise UserError(
                "data: batches carry no final_hidden (tokens-only data is for head.joint=true); "
                "prepare the data with +head=medusa head.joint=false"
            )
        batch = indexed(batch, self.batch_index)
        ids, mask = batch["input_ids"], batch["loss_mask"]
        trained = trained_mask(batch, self.objective.prompt_weight)
        loss, sums = head_losses(
            self.head, batch["final_hidden"], ids, mask, self.head_weight, batch, self.objective, trained
        )
        return {"loss": loss, **sums}

    summarize = staticmethod(summarize_heads)

    def param_groups(self, lr: float, weight_decay: float) -> list[dict]:
        return [{"params": list(self.head.parameters()), "lr": lr, "weight_decay": weight_decay}]

    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        head_state = None if state is None else strip_prefix(state, "head.")
        return self.head.save_pretrained(out_dir, state=head_state)

    def drafter(self, target) -> tuple[MedusaDrafter, object]:
        return MedusaDrafter(self.head, target.config.get_text_config().num_hidden_layers), target


def trainable_target(target, lora_rank: int, checkpointing: bool = False):
    """A trainable copy of the frozen target (the original stays the teacher and the baseline):
    all weights, or LoRA adapters (alpha = 2 * rank) on every linear layer but the lm_head.

    What trains is float32 whatever the target's dtype, the master weights the heads have too:
    on a GPU the target is bf16, whose resolution is 2**-8 of a weight, and AdamW's steps (lr
    times about one) round away in bf16 weights and moments. Under mixed precision autocast
    still computes in bf16. A LoRA copy's frozen base stays in the target's dtype.
    `checkpointing` (a full copy): each decoder layer's activations are recomputed in backward
    rather than kept, the memory a GPU lacks for an 8B target's layers; not asked on a CPU,
    where memory is plenty and the recomputation costs a third more time."""
    student = copy.deepcopy(target)
    if lora_rank == 0:
        student = student.float().requires_grad_(True)
        if checkpointing:
            student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return student
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear"
    )
    adapted = get_peft_model(student, lora)
    for param in adapted.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return adapted


class JointMedusaTrainee(nn.Module):
    """Medusa-2: the target (`self.target`, full or LoRA) trained together with the heads.

    loss = LM term + joint_head_loss_scale * sum_k head_weight**k CE_k, the heads reading the
    trained target's own final hidden states. The LM term is KL to the original target's
    next-token distribution with `self_distill` (so its outputs do not drift), otherwise CE to
    the data's next token. For the first `head.head_warmup_steps` optimizer steps the head loss
    does not reach the target (Medusa-2's heads warmup): fresh heads are far off, and their
    large gradients would otherwise pull the target away before the heads have learnt anything.
    The original target is kept out of the module tree on purpose: DDP/DeepSpeed, checkpoints
    and saved states must not carry a frozen second copy. The heads' terms follow the
    `head.*` objective (prompt rows, per-row loss); the LM term stays on the answer tokens.
    """

    def __init__(self, head: MedusaHead, target, cfg: MedusaConfig, grad_accum: int = 1):
        super().__init__()
        self.head = head
        self.target = trainable_target(target, cfg.lora_rank, checkpointing=target.device.type == "cuda")
        self.__dict__["teacher"] = target if cfg.self_distill else None
        self.cfg = cfg
        self.objective = Objective.from_config(cfg)
        self.batch_index = partial(label_batch_index, prompt_weight=cfg.prompt_loss_weight)
        self.warmup_batches = cfg.head_warmup_steps * grad_accum
        # Training batches seen: a buffer, so checkpoints carry it and a resumed run agrees.
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Batches are right-padded, so under the causal mask no real position attends to a pad:
        the decoders run without the attention mask, which transformers would read back (a
        sync) to decide whether SDPA may run as plain causal attention. Packed rows pass their
        positions and a ready-made 4D mask (`document_inputs`), which it takes as they are, built
        per model: the trained float32 copy and a bf16 teacher differ in dtype. (`use_cache=False`
        would build no cache, but reads the device back in transformers' mask code: 4 syncs a
        step, `tests/unit/trainer/test_sync_free.py`.)"""
        batch = indexed(batch, self.batch_index)
        ids, mask = batch["input_ids"], batch["loss_mask"]
        hidden = self._final_hidden(self.target, batch)
        rows, targets, counted = offset_rows(ids, mask, batch[LABEL_INDEX], 1, batch[LABEL_POSITION])
        teacher_project = teacher_rows = None
        if self.teacher is not None:
            with torch.no_grad():
                teacher_hidden = self._final_hidden(self.teacher, batch)
                teacher_rows = teacher_hidden.flatten(0, 1).index_select(0, rows)
            teacher_project = self.teacher.get_output_embeddings()
        lm_sum, lm_top1, _ = token_loss(
            self.target.get_output_embeddings(),
            hidden.flatten(0, 1).index_select(0, rows),
            targets,
            teacher_project,
            teacher_rows,
            counted=counted,
        )
        n = counted.sum()
        if self.training:
            self.batches_seen += 1
        # Decided on the device, as reading the count back would sync: while warming up, the
        # head loss reaches the target with a zero gradient.
        warming = self.batches_seen <= self.warmup_batches
        head_input = torch.where(warming, hidden.detach(), hidden)
        trained = trained_mask(batch, self.objective.prompt_weight)
        head_loss, sums = head_losses(
            self.head, head_input, ids, mask, self.cfg.head_weight, batch, self.objective, trained
        )
        loss = lm_sum / n.clamp(min=1) + self.cfg.joint_head_loss_scale * head_loss
        lm = torch.stack([lm_sum.detach(), lm_top1.to(lm_sum.dtype), n.to(lm_sum.dtype)])
        return {"loss": loss, "lm": lm, **sums}

    @staticmethod
    def _final_hidden(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        packed = document_inputs(model, batch["position_ids"]) if "position_ids" in batch else {}
        return model.get_decoder()(input_ids=batch["input_ids"], **packed).last_hidden_state

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Head metrics plus `lm_loss` (KL or CE per token) and `lm_top1` (agreement with the
        original target's argmax when distilling, else accuracy on the data's next token)."""
        lm_sum, lm_top1, n = sums["lm"].tolist()
        lm = {"lm_loss": lm_sum / max(n, 1), "lm_top1": lm_top1 / max(n, 1)}
        return {**summarize_heads(sums), **lm}

    def param_groups(self, lr: float, weight_decay: float) -> list[dict]:
        target = [p for p in self.target.parameters() if p.requires_grad]
        return [
            {"params": target, "lr": lr, "weight_decay": weight_decay},
            {
                "params": list(self.head.parameters()),
                "lr": lr * self.cfg.head_lr_scale,
                "weight_decay": weight_decay,
            },
        ]

    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        """The head folder with the trained target inside it, in `TARGET_DIR`: a peft adapter
        folder (LoRA) or a Hugging Face model folder (full), both written before the folder
        appears under its final name."""
        state = state or self.state_dict()
        out = Path(out_dir)
        with staged_dir(out) as tmp:
            self.head.save_pretrained(tmp, state=strip_prefix(state, "head."))
            self.target.save_pretrained(tmp / TARGET_DIR, state_dict=strip_prefix(state, "target."))
            write_target_checksums(tmp / TARGET_DIR)
        return out

    def drafter(self, target) -> tuple[MedusaDrafter, object]:
        """The heads verified by the target in training. With LoRA, the peft wrapper's base
        model: its layers carry the active adapters, its forward the decoder's cache argument."""
        verifier = self.target.get_base_model() if self.cfg.lora_rank else self.target
        layers = verifier.config.get_text_config().num_hidden_layers
        return MedusaDrafter(self.head, layers), verifier


@torch.no_grad()
def greedy_token_drift(original, tuned, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Share of the original target's greedy tokens that a jointly trained target changes.

    Each prompt's greedy continuation by `original` is run through both models and their argmax
    compared at the continuation's positions: a per-token rate, where comparing two free-running
    generations would count every token after the first difference as changed."""
    changed = total = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=original.device)
        seq = original.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=original.config.eos_token_id,
        )
        span = slice(len(prompt) - 1, seq.shape[1] - 1)
        before = original(seq).logits[0, span].argmax(-1)
        after = tuned(seq.to(tuned.device)).logits[0, span].argmax(-1).to(before.device)
        changed += int((before != after).sum())
        total += before.numel()
    return changed / max(total, 1)


def medusa_activations(cfg, rows: RowSizes) -> int:
    """Bytes a Medusa step keeps per token, an estimate: `num_heads` heads of `num_layers` blocks
    (2 hidden-sized values each) and a float32 full-vocabulary distribution per head."""
    head = cfg.head
    return head.num_heads * (head.num_layers * 2 * rows.hidden * rows.act + FP32 * rows.vocab)


def build_medusa_trainee(cfg, target, data_dir: Path) -> nn.Module:
    """Fresh heads for `target`; with `head.joint` also a trainable copy of the target. The data
    folder is not read here: Medusa has no draft vocabulary."""
    head = MedusaHead.from_target(target, cfg.target.name_or_path, cfg.head)
    if cfg.head.joint:
        return JointMedusaTrainee(head, target, cfg.head, cfg.optim.grad_accum)
    return MedusaTrainee(head, cfg.head.head_weight, Objective.from_config(cfg.head))


def medusa_drafter(head: MedusaHead, target, shapes: Sequence[Shape] = ()) -> MedusaDrafter:
    """Loaded heads as the decoding drafter on `target`'s final hidden state, refusing a shape
    that asks for more heads than there are."""
    drafter = MedusaDrafter(head, target.config.get_text_config().num_hidden_layers)
    for shape in shapes:
        drafter.check(shape)
    return drafter
