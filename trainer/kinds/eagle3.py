"""How an EAGLE-3 head learns: the training-time-test (TTT) unroll against the target's distribution.

`Eagle3Trainee` (a `trainer.trainee.Trainee`) is the trainable head plus the frozen rows of the
target lm_head that turn stored final hidden states into the teacher's distribution over the
draft vocabulary (`draft_teacher`). The target's own choice at each position, which takes the
full vocabulary, comes with the batch (`data_prep.states.capture.TOP`), computed once by capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from conf.errors import UserError
from data_prep.states.capture import NONFINITE, TOP
from heads.eagle3.model import Branches, Eagle3Head, branch_scores, context_attention, fused_kernels
from heads.formats import read_init_head
from heads.window import near, window_of
from trainer.decoding import Eagle3Drafter
from trainer.decoding.drafters import Shape
from trainer.objective import CROSS_ENTROPY, Objective
from trainer.trainee import (
    FP32,
    LABEL_INDEX,
    LABEL_POSITION,
    Batch,
    HeadTrainee,
    RowSizes,
    indexed,
    label_batch_index,
    position_ids,
    shift_left,
    trained_mask,
)

ANCHORS = "on_policy_anchors"  # [B]: where each on-policy row's draft starts (`on_policy_rows`)
LABEL_WEIGHT = "label_weight"  # [B,T] float: a weight on each label's rows (`on_policy_batch`)


def context_mask(
    positions: torch.Tensor, seq_len: int, starts: torch.Tensor | None = None,
    window: int | None = None, depth: int = 0,
) -> torch.Tensor:
    """Bool [B,S,T]: the verified context's keys (step 0's K/V over all T positions) that the
    queries at row positions `positions` [B,S], `depth` steps into their draft, may attend to:
    causal from where each query's document `starts` [B,S] (packed rows; None: one per row), and
    with a `window` (`heads.window`) only keys less than `window` before the query's own
    position, `positions` + `depth`, as the decoder's cache mask slides."""
    keys = torch.arange(seq_len, device=positions.device)
    causal = keys[None, None, :] <= positions[:, :, None]
    if starts is not None:
        causal &= keys[None, None, :] >= starts[:, :, None]
    return causal & near(positions + depth, keys, window)


def ttt_attention_mask(
    positions: torch.Tensor, seq_len: int, step: int, starts: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Bool [B,1,S,T+step*S]: what the queries of unroll step `step` may attend to.

    `positions` [B,S] are the sequence positions the step computes (all T at step 0, only those a
    later loss reads afterwards). Keys are step 0's K/V over all T positions (`context_mask`),
    then each later step's K/V over the S rows: the diagonal, since the draft token at a position
    exists only on that position's own branch, exactly what a chain decoder's cache holds at
    inference (a window holds the whole branch: the config keeps the steps below it).
    """
    eye = torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device)
    diag = eye.expand(positions.shape[0], -1, -1)
    context = context_mask(positions, seq_len, starts, window, step)
    return torch.cat([context] + [diag] * step, dim=2)[:, None]


def context_step_mask(
    positions: torch.Tensor, seq_len: int, starts: torch.Tensor | None, window: int | None, fused: bool
) -> torch.Tensor | None:
    """Step 0's mask (`ttt_attention_mask`), or None on the `fused` path where it is exactly
    causal (one document a row, `starts` None, and no window): SDPA then runs it as flash with
    GQA on CUDA (`heads.eagle3.model.context_attention`). Decided by the batch's layout alone,
    never by reading a tensor: the training step stays sync-free."""
    if fused and starts is None and window is None:
        return None
    return ttt_attention_mask(positions, seq_len, 0, starts, window)


def attention_kernels(
    head: Eagle3Head, batch_size: int, seq_len: int, packed: bool = False
) -> dict[str, object]:
    """Which attention a training step of `head` (its device, dtype, heads and window) takes at
    rows of `seq_len` tokens, for a GPU check to report: `fused` (`fused_kernels`, the switch
    `heads.eagle3.model.FUSED_KERNELS` sets: False is the old path), `step0_mask` (None: exactly
    causal, no mask; "bool"), `step0_kernels` (the SDPA backends that accept step 0's call, forward
    and backward, each tried alone: "math" alone means [B, H, T, T] scores), and the later TTT
    steps' `ttt_rows_per_chunk` and `ttt_chunks` (`branch_scores`, at as many rows as tokens).
    `packed`: two documents a row, as `trainer.batching.pack_row` lays them out."""
    cfg, weight = head.config, head.fc.weight
    b, h, kv, d, t = batch_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, seq_len
    fused = fused_kernels(weight)
    pos = torch.arange(t, device=weight.device).expand(b, t)
    starts = torch.where(pos >= t // 2, t // 2, 0) if packed else None
    mask = context_step_mask(pos, t, starts, window_of(cfg), fused)
    q = torch.randn(b, h, t, d, device=weight.device, dtype=weight.dtype, requires_grad=True)
    k, v = (torch.randn(b, kv, t, d, device=weight.device, dtype=weight.dtype, requires_grad=True)
            for _ in range(2))
    kernels = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                context_attention(q, k, v, mask, fused).sum().backward()
        except RuntimeError:  # "No available kernel": this backend refuses the call
            continue
        kernels.append(backend.name.lower().removesuffix("_attention"))
    rows = max(1, branch_scores(q) // (b * h * t))
    return {
        "fused": fused,
        "step0_mask": None if mask is None else "bool",
        "step0_kernels": kernels,
        "ttt_rows_per_chunk": rows,
        "ttt_chunks": -(-t // rows),
    }


def gather_positions(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [B,T] -> (positions [B,S] in ascending order, padded with 0; valid [B,S]), S = the
    largest per-row count (read from `keep`: run it on the CPU, see `ttt_batch_index`)."""
    counts = keep.sum(1)
    width = max(1, int(counts.max()))
    order = torch.sort((~keep).int(), dim=1, stable=True).indices[:, :width]
    valid = torch.arange(width, device=keep.device)[None] < counts[:, None]
    return torch.where(valid, order, 0), valid


def ttt_batch_index(
    batch: Batch, ttt_length: int, prompt_weight: float = 0.0, anchors: torch.Tensor | None = None
) -> Batch:
    """`Eagle3Trainee.batch_index`: where each of the N labels is read at each unroll step.

    Label j at flat position (row, u) is predicted at step k from position u-2-k, if that is in
    its own sample (its `label_position` is >= 2+k). Adds `label_batch_index`'s fields;
    `ttt_positions`, `ttt_valid` [B,S]: the positions the later steps run (`gather_positions` of
    those any later step predicts a label from); `ttt_rows` [K,N]: label j's row among step k's
    flattened hidden states (0 where it has none there); `ttt_counted` [K,N]: whether step k
    predicts label j. The labels are `trained_mask`'s. `anchors` [B,T] (None: all): the only
    positions the later steps run, a sub-sample that bounds their cost.
    """
    mask = trained_mask(batch, prompt_weight)
    index = label_batch_index(batch, prompt_weight)
    labels, places = index[LABEL_INDEX], position_ids(batch)
    later = torch.zeros_like(mask)
    for k in range(1, ttt_length):
        later |= shift_left(mask & (places >= 2 + k), 2 + k, False)
    if anchors is not None:
        later &= anchors
    positions, valid = gather_positions(later)
    # Where each position sits among its row's gathered ones (garbage, clamped, where it is none).
    column = (later.long().cumsum(1) - 1).flatten()
    row_start = labels // mask.shape[1] * positions.shape[1]
    rows = [(labels - 2).clamp(min=0)]  # step 0 runs every position
    counted = [index[LABEL_POSITION] >= 2]
    flat_later = later.flatten()
    for k in range(1, ttt_length):
        source = (labels - 2 - k).clamp(min=0)
        rows.append(row_start + column[source].clamp(min=0))
        counted.append((index[LABEL_POSITION] >= 2 + k) & flat_later[source])
    return {
        **index,
        "ttt_positions": positions,
        "ttt_valid": valid,
        "ttt_rows": torch.stack(rows),
        "ttt_counted": torch.stack(counted),
    }


@torch.no_grad()
def draft_teacher(
    final_hidden: torch.Tensor,
    draft_lm_head: torch.Tensor,
    target_top: torch.Tensor,
    target_to_draft: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a head drafting over a draft vocabulary learns from, at N rows: (the target's
    probabilities over the draft vocabulary, renormalised, float32 [N, Vd]; the target's top-1 as
    a draft id, -1 where it lies outside the draft vocabulary, [N]).

    `final_hidden` [N, H]: the target's final hidden states; `draft_lm_head` [Vd, H]: the target
    lm_head's rows of the draft ids in order; `target_top` [N]: the target's top-1 (target) id
    at those rows, the argmax over the whole vocabulary that capture kept; `target_to_draft` [V]:
    target id -> draft id or -1. The renormalised softmax reads the draft ids' logits alone, so
    this equals the full-vocabulary computation (logits of every row, their argmax, a softmax over
    the draft columns) at a draft-vocabulary's share of its multiply-adds. The product runs in
    `draft_lm_head`'s dtype, the training dtype (`trainer.trainee.store_frozen_tables`: 16 bits
    under mixed precision, DeepSpeed's runs included), the softmax in float32.
    """
    logits = final_hidden.to(draft_lm_head.dtype) @ draft_lm_head.T
    return F.softmax(logits.float(), dim=-1), target_to_draft[target_top.long()]


class Eagle3Trainee(HeadTrainee, nn.Module):
    frozen_tables = ("head.embed_tokens.weight", "teacher_weight")

    def __init__(
        self,
        head: Eagle3Head,
        target_lm_head: torch.Tensor,
        ttt_length: int,
        step_weight: float,
        objective: Objective = CROSS_ENTROPY,
    ):
        super().__init__()
        self.head = head
        self.ttt_length, self.step_weight, self.objective = ttt_length, step_weight, objective
        self.window = window_of(head.config)  # as the decoder reads it (`heads.window`)
        self.batch_index = partial(
            ttt_batch_index, ttt_length=ttt_length, prompt_weight=objective.prompt_weight
        )
        # The target lm_head's draft-vocabulary rows: all the teacher multiplies by.
        rows = target_lm_head.detach()[head.draft_token_ids().to(target_lm_head.device)]
        self.register_buffer("teacher_weight", rows.float(), persistent=False)
        # target id -> draft id (or -1): the draft vocabulary is sorted, so a cumulative count.
        t2d = head.t2d
        self.register_buffer(
            "target_to_draft", torch.where(t2d, t2d.long().cumsum(0) - 1, -1), persistent=False
        )

    def teacher(
        self, final_hidden: torch.Tensor, target_top: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft_teacher` with this trainee's lm_head rows and vocabulary map, for final hidden
        states [N, H] and the target's top-1 ids [N] at the same rows."""
        return draft_teacher(final_hidden, self.teacher_weight, target_top, self.target_to_draft)

    def unroll(
        self,
        aux_hidden: torch.Tensor,
        ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (k, fed-back hidden [B,S,H], positions [B,S], valid [B,S]) for each TTT step.

        Position t reads token t+1+k and predicts token t+2+k; step k>0 feeds back the head's own
        hidden state from step k-1. Step 0 runs every position (all are keys of the context);
        later steps run only the positions in `keep` (default all), since a later step's row
        depends on nothing but its own branch: on chat data this skips the unlabelled prompt.
        `position_ids` [B,T] (packed rows, see `trainer.batching.pack_row`; None: 0..T-1, one
        sample a row) keep each sample's attention and rotary positions its own. Step 0's mask
        is exactly causal where they are None and there is no window: on the fused-kernel path
        (`heads.eagle3.model.fused_kernels`) it passes none, which CUDA runs as flash with GQA;
        a fact of the batch's layout, known on the host, so the step reads no device tensor.
        Near a sample's end a branch reads the next sample's tokens, and predicts them: the loss
        counts no such prediction, and no other branch attends to it.
        """
        later = None if keep is None else gather_positions(keep)
        return self.unroll_gathered(aux_hidden, ids, later, position_ids)

    def unroll_gathered(
        self,
        aux_hidden: torch.Tensor,
        ids: torch.Tensor,
        later: tuple[torch.Tensor, torch.Tensor] | None,
        position_ids: torch.Tensor | None = None,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`unroll` with the later steps' (positions, valid) already gathered, as the batch
        loader does on the CPU: counting them here would sync."""
        b, t = ids.shape
        hidden = self.head.fuse(aux_hidden.to(self.head.fc.weight.dtype))
        pos = torch.arange(t, device=ids.device).expand(b, t)
        places = pos if position_ids is None else position_ids
        valid = torch.ones_like(pos, dtype=torch.bool)
        for k in range(self.ttt_length):
            if k == 1 and later is not None:
                pos, valid = later
                hidden = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
            at = places.gather(1, pos)  # each row's position in its own sample
            if k == 0:  # the context: causal within each document
                starts = None if position_ids is None else pos - at
                mask = context_step_mask(pos, t, starts, self.window, fused_kernels(hidden))
                hidden, context = self.head.layer(hidden, shift_left(ids, 1, 0), at, mask)
            else:  # step 0's keys under the same rule (a window slides with k), then this row's branch
                hidden, tokens = self.step_input(k, hidden, ids, pos)
                if k == 1:
                    branches = Branches(context, None)
                mask = context_mask(pos, t, pos - at, self.window, k)[:, None]
                hidden, kv = self.head.layer(hidden, tokens, at + k, None, branches._replace(mask=mask))
                branches = branches._replace(steps=(*branches.steps, kv))
            yield k, hidden, pos, valid

    def step_input(
        self, k: int, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B,S,H], token ids [B,S]) that unroll step k >= 1 reads at rows `pos`: step
        k-1's output `hidden` and the token k+1 after each row, as the chain decoder feeds back its
        own state with the token it drafted (teacher-forced here)."""
        return hidden, shift_left(ids, 1 + k, 0).gather(1, pos)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loss and metric sums for one batch. Metric sums are per unroll step:
        `correct[k]`/`total[k]` = draft top-1 == target top-1 at answer positions (prompt rows,
        trained with a prompt weight, are left out: the metrics stay comparable across weights).
        Each step's loss is the `objective`'s weighted mean over its rows.

        Logits (draft and teacher) are computed only at the N labelled rows (`ttt_batch_index`):
        the label mask of assistant tokens usually leaves out the prompt, and the vocab
        projections dominate. Every step computes all N, at fixed shapes, and masks out those it
        has no prediction for (fewer than 2+k tokens of its sample before it, or an anchor the
        step did not run: `ttt_counted`) or whose target
        token is outside the draft vocabulary."""
        batch = indexed(batch, self.batch_index)
        ids, labels, rows = batch["input_ids"], batch[LABEL_INDEX], batch["ttt_rows"]
        # Step k predicts a label from its own sample only, and from a position the step ran.
        predicted = batch["ttt_counted"]
        # The target's distribution for the token at u is the one it computed at u-1.
        before = (labels - 1).clamp(min=0)
        final = batch["final_hidden"].flatten(0, 1).index_select(0, before)
        teacher_p, teacher_top = self.teacher(final, batch[TOP].flatten().index_select(0, before))
        answer = batch["loss_mask"].flatten().index_select(0, labels)
        weight = self.objective.row_weights(answer)
        if LABEL_WEIGHT in batch:  # on-policy rows: each draft counted up to the first rejected
            weight = weight * batch[LABEL_WEIGHT].flatten().index_select(0, labels)
        inside = teacher_top >= 0  # the target's choice is inside the draft vocabulary
        loss = teacher_p.new_zeros(())
        correct = teacher_p.new_zeros(self.ttt_length)
        total = teacher_p.new_zeros(self.ttt_length)
        later = (batch["ttt_positions"], batch["ttt_valid"])
        steps = self.unroll_gathered(batch["aux_hidden"], ids, later, batch.get("position_ids"))
        for k, hidden, _, _ in steps:
            labelled = predicted[k]
            counted = labelled & inside
            logits = self.head.logits(hidden.flatten(0, 1).index_select(0, rows[k]))
            term, correct[k] = self.objective.step_term(logits, teacher_p, teacher_top, counted, weight,
                                                        answer)
            loss = loss + self.step_weight**k * term
            total[k] = (labelled & answer).sum()
        return {"loss": loss, "correct": correct, "total": total}

    def drafter(self, target) -> tuple[Eagle3Drafter, object]:
        return Eagle3Drafter(self.head), target

    @torch.no_grad()
    def draft_chain(self, aux_hidden: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Target ids [B, ttt_length]: the argmax chain the head drafts at row b after position
        `anchors[b]`, with the verified context ids[b, :anchors[b] + 2] and its target features
        `aux_hidden` [B,T,3H]: the draft at anchor+2, then each next one from the hidden state
        and the token the step before fed back, as `Eagle3Drafter.propose` grows a chain (the
        unroll's branch attention is the chain decoder's cache, `unroll`). Each step's token is
        written into the ids the next step reads (`step_input` reads them lazily), into K
        columns of padding, so a row cut at its last token drafts past it."""
        k = self.ttt_length
        ids = F.pad(ids, (0, k))
        at = anchors[:, None]
        later = (at, torch.ones_like(at, dtype=torch.bool))
        drafts = []
        for step, hidden, _, _ in self.unroll_gathered(F.pad(aux_hidden, (0, 0, 0, k)), ids, later):
            if step == 0:  # step 0 ran every position: the anchor's
                hidden = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
            token = self.head.to_target_ids(self.head.logits(hidden[:, 0]).argmax(-1))
            ids.scatter_(1, at + 2 + step, token[:, None])
            drafts.append(token)
        return torch.stack(drafts, 1)

    def on_policy_rows(self, batch: Batch, generator: torch.Generator) -> Batch:
        """`on_policy_rows` of a loader batch, drafting `ttt_length` tokens: the steps the
        unroll trains, and the chain the decoder's default k drafts."""
        return on_policy_rows(batch, self.ttt_length, generator)

    def on_policy_batch(self, batch: Batch, rows: Batch, capture: Callable[[Batch], Batch]) -> Batch:
        """The batch an on-policy step trains on, on the device: `rows` (`on_policy_rows`, laid
        out on the host from the loader's `batch`) with the head's drafts (`draft_chain`, from
        `batch`'s target features) in their draft columns, the fields the target's `capture`
        computes over them (its distributions and states where the drafts took it), and
        `LABEL_WEIGHT`: draft j counts where drafts 1..j-1 equal the target's greedy choice
        there (the first rejected one is where the head learns most; after it, context serving
        never reaches). Reads nothing back: the layout came from the host."""
        anchors = rows[ANCHORS]
        drafts = self.draft_chain(batch["aux_hidden"], batch["input_ids"], anchors)
        cols = anchors[:, None] + 2 + torch.arange(drafts.shape[1], device=drafts.device)
        ids = rows["input_ids"].scatter(1, cols, drafts)
        fields = capture({"input_ids": ids, "attention_mask": rows["attention_mask"]})
        fields.pop(NONFINITE, None)  # the loss's own check stops the run on what would overflow here
        accepted = (drafts == fields[TOP].gather(1, cols - 1)).float()
        reached = torch.cat([torch.ones_like(accepted[:, :1]), accepted[:, :-1]], 1).cumprod(1)
        weight = torch.zeros_like(ids, dtype=torch.float32).scatter(1, cols, reached)
        return {**rows, "input_ids": ids, **fields, LABEL_WEIGHT: weight}


def on_policy_rows(batch: Batch, drafts: int, generator: torch.Generator) -> Batch:
    """The host's half of an on-policy batch (`Eagle3Trainee.on_policy_batch`): each row of
    the loader's padded `batch` cut after a random anchor t with an answer token at t+1 (the
    verified token the draft follows; a row without one: its last two tokens), then `drafts`
    columns for the head's drafts (zero until drafted), labelled (`loss_mask`) there and nowhere
    else; `ANCHORS` [B], and `ttt_batch_index`'s fields of that layout (a fact of the anchors,
    not of the drafted tokens), computed here where reading the mask costs no device wait.
    `generator` picks the anchors: seeded by the step, a resumed run cuts the same rows."""
    ids, keep = batch["input_ids"], batch["attention_mask"].bool()
    follows = shift_left(batch["loss_mask"] & keep, 1, False)
    pick = torch.where(follows, torch.rand(ids.shape, generator=generator), -1.0).argmax(1)
    last = (keep.sum(1) - 2).clamp(min=0)
    anchors = torch.where(follows.any(1), pick, last)
    cut = anchors + 2
    width = int(cut.max()) + drafts
    cols = torch.arange(width)[None]
    prefix = F.pad(ids, (0, max(0, width - ids.shape[1])))[:, :width]
    rows = {
        "input_ids": torch.where(cols < cut[:, None], prefix, 0),
        "attention_mask": (cols < cut[:, None] + drafts).long(),
        "loss_mask": (cols >= cut[:, None]) & (cols < cut[:, None] + drafts),
        ANCHORS: anchors,
    }
    return rows | ttt_batch_index(rows, drafts)


def init_vocab(cfg, target) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of `head.init_from`'s head: its lm_head's rows are those ids, so a run that starts
    from it keeps them (the data's own vocabulary is not used). The teacher maps target ids to
    draft ids by counting `t2d` (`Eagle3Trainee`), so the draft ids must be ascending target ids
    and `t2d` exactly those: draftsmith's and speculators' are; another is refused."""
    read = read_init_head(cfg, target.config)
    d2t, t2d = read.tensors["d2t"].long(), read.tensors["t2d"].bool()
    ids = torch.arange(len(d2t), device=d2t.device) + d2t  # on the CPU under a meta build too
    marked = torch.zeros_like(t2d).index_fill_(0, ids.clamp(0, len(t2d) - 1), True)
    if not (bool((ids[1:] > ids[:-1]).all()) and torch.equal(marked, t2d)):
        raise UserError(
            f"{read.where}: its draft vocabulary is not ascending target ids with t2d marking exactly "
            "them (d2t, t2d), which training over it needs"
        )
    return d2t, t2d


def draft_vocab(cfg, target, data_dir: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a fresh head: the draft vocabulary built with the data (no data folder: the
    lowest ids, which cost a step what any vocabulary of that size costs); with `head.init_from`,
    that head's (`init_vocab`)."""
    from data_prep.folders.vocab import build_draft_vocab, load_draft_vocab

    if cfg.head.init_from:
        return init_vocab(cfg, target)
    if data_dir is None:
        vocab = target.config.get_text_config().vocab_size
        counts = torch.zeros(vocab, dtype=torch.long)
        return build_draft_vocab(counts, min(cfg.data.draft_vocab_size, vocab))
    return load_draft_vocab(data_dir)


def eagle3_activations(cfg, rows: RowSizes) -> int:
    """Bytes an EAGLE-3 (or P-EAGLE) step keeps per token, an estimate: the inputs (3 aux layers
    and the final state, float32) and `fc`'s, then per draft row (`ttt_length` per token, times
    P-EAGLE's `parallel_tokens`) a layer and the float32 probabilities over the draft vocabulary
    of the loss's chunks, the teacher's float32 distribution once, and step 0's attention scores
    and probabilities in float32 over the row's `max_length` keys (SDPA with a mask runs its math
    kernel on a CPU; CUDA's fused kernels keep less, `context_attention`: an upper bound there)."""
    head, h = cfg.head, rows.hidden
    vd = min(cfg.data.draft_vocab_size, rows.vocab)
    drafted = (head.ttt_length or 1) * getattr(head, "parallel_tokens", 1)
    attention = 2 * FP32 * rows.heads * cfg.data.max_length
    return 4 * h * FP32 + 3 * h * rows.act + drafted * (rows.layer + FP32 * vd) + FP32 * vd + attention


def build_eagle3_trainee(cfg, target, data_dir: Path | None) -> Eagle3Trainee:
    """A fresh head for `target` over the draft vocabulary of `draft_vocab`."""
    d2t, t2d = draft_vocab(cfg, target, data_dir)
    head = Eagle3Head.from_target(target, cfg.target.name_or_path, cfg.head, d2t, t2d)
    lm_head = target.get_output_embeddings().weight
    objective = Objective.from_config(cfg.head)
    return Eagle3Trainee(head, lm_head, cfg.head.ttt_length, cfg.head.step_weight, objective)


def eagle3_drafter(head: Eagle3Head, target, shapes: Sequence[Shape] = ()) -> Eagle3Drafter:
    """A loaded head as the decoding drafter: it grows any chain or tree (`shapes` are all fine)."""
    return Eagle3Drafter(head)
