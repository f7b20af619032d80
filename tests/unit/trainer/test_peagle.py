"""P-EAGLE training and drafting: the drafter's one forward per draft gives the very logits the
trainee computes for the same slots (vLLM's layout: verified positions, then K-1 mask slots), the
training mask is the rule the peers and vLLM's drafter share, anchor sub-sampling is seeded and
counted, and greedy speculative decoding with a briefly trained head equals the target's own
`generate` token for token while accepting drafts at every slot."""

from __future__ import annotations

import pytest
import torch

from conf.kinds import PEagleConfig
from data_prep.states.capture import TOP, greedy_ids
from heads.peagle.model import PEagleHead
from tests.support.decode import chaotic_target
from trainer.decoding import Chain, Sampling, speculative_generate
from trainer.decoding.peagle import PEagleDrafter
from trainer.kinds.peagle import PEagleTrainee, peagle_batch_index, peagle_drafter

pytestmark = pytest.mark.usefixtures("single_thread")
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def target():
    return chaotic_target("llama")


def fresh_head(target, k: int = 3, draft_vocab: int | None = None, window: int | None = None) -> PEagleHead:
    """A random head whose output leans on attention (so a wrong mask or position shows), over the
    whole vocabulary or every other id."""
    v = target.config.vocab_size
    if draft_vocab is None:
        d2t, t2d = torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    else:
        ids = torch.arange(0, 2 * draft_vocab, 2)
        d2t, t2d = ids - torch.arange(draft_vocab), torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
    torch.manual_seed(0)
    cfg = PEagleConfig(aux_layer_ids=AUX, parallel_tokens=k, mask_token_id=7, sliding_window=window)
    head = PEagleHead.from_target(target, "tiny", cfg, d2t, t2d)
    attn = head.midlayer.self_attn
    for proj, scale in ((attn.q_proj, 4.0), (attn.k_proj, 4.0), (attn.o_proj, 20.0)):
        proj.weight.data.mul_(scale)
    return head.eval()


def aux_features(target, seq: torch.Tensor) -> list[torch.Tensor]:
    hs = target(seq[None], output_hidden_states=True).hidden_states
    return [hs[i][0] for i in AUX]


class Spy(PEagleDrafter):
    """Records the draft-vocab logits each drafted token was picked from."""

    def _pick(self, logits, sampling):
        self.seen.append(logits.clone())
        return super()._pick(logits, sampling)


@pytest.mark.parametrize("window", [None, 16])
@torch.no_grad()
def test_one_forward_draft_equals_the_trainees_slots(target, window):
    """With a window (`head.sliding_window`) too: the anchors sit past it, where it hides keys."""
    head = fresh_head(target, k=4, draft_vocab=64, window=window)
    trainee = PEagleTrainee(head, target.get_output_embeddings().weight, 4, 0.8)
    seq = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    feats = aux_features(target, seq)
    steps = list(trainee.unroll(torch.cat(feats, -1)[None], seq[None]))
    drafter = Spy(head)
    assert drafter.window == window
    drafter.seen = []
    a = 26  # the first draft at anchor 26; then 3 tokens verified, the next draft at anchor 29
    drafter.start(seq[: a + 1], [f[: a + 1] for f in feats], int(seq[a + 1]))
    drafts = [drafter.propose(Chain(4), Sampling())]
    drafter.commit(seq[a + 1 : 30], [f[a + 1 : 30] for f in feats], int(seq[30]))
    drafts.append(drafter.propose(Chain(4), Sampling()))
    assert drafter.length == 30  # the cache holds verified positions only
    for anchor, got, draft in zip((a, 29), (drafter.seen[:4], drafter.seen[4:]), drafts):
        want = [head.logits(hidden[0, anchor]) for _, hidden, _, _ in steps]
        for slot, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=f"slot {slot + 1}")
        assert draft.tokens.tolist() == [int(head.to_target_ids(w.argmax())) for w in want]


def peers_mask(doc: torch.Tensor, anchors: list[int], slots: int) -> torch.Tensor:
    """Bool [R,R] over [slot 1 of every position | slot k of each anchor, k = 2..slots]: slot k at
    anchor a sees slot 1 of every position b <= a of its document, and slots 2..k of its own
    anchor (speculators' and SpecForge's `peagle_mask_mod`, and vLLM's causal draft)."""
    rows = [(0, p) for p in range(len(doc))] + [(k, a) for k in range(1, slots) for a in anchors]
    return torch.tensor([[(kk == 0 and ak <= aq and doc[ak] == doc[aq]) or (kk > 0 and ak == aq and kk <= kq)
                          for kk, ak in rows] for kq, aq in rows])


@torch.no_grad()
def test_slots_equal_vllms_one_forward_under_the_peers_mask_on_packed_rows(target):
    """The unroll (slot by slot, EAGLE-3's branch attention) gives the very outputs of one
    forward over every slot with the peers' mask, on a row of two packed documents and a pad."""
    head = fresh_head(target, k=3)
    trainee = PEagleTrainee(head, target.get_output_embeddings().weight, 3, 0.8)
    places = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0]])
    doc = torch.tensor([0] * 6 + [1] * 4 + [2])
    t, anchors = places.shape[1], [1, 3, 5, 7, 8]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, t), generator=g)
    aux = torch.randn(1, t, 3 * target.config.hidden_size, generator=g)
    pos = torch.tensor([anchors])
    steps = list(trainee.unroll_gathered(aux, ids, (pos, torch.ones_like(pos, dtype=torch.bool)), places))
    at = places[0, anchors]
    hidden = torch.cat([head.fuse(aux), head.mask_state().expand(1, 2 * len(anchors), -1)], 1)
    tokens = torch.cat([torch.cat([ids[:, 1:], ids[:, :1] * 0], 1), torch.full((1, 2 * len(anchors)), 7)], 1)
    positions = torch.cat([places[0], at + 1, at + 2])[None]
    out, _ = head.layer(hidden, tokens, positions, peers_mask(doc, anchors, 3)[None, None])
    n = len(anchors)
    for k, got, _, _ in steps:
        want = out[:, :t] if k == 0 else out[:, t + (k - 1) * n : t + k * n]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"slot {k + 1}")


def test_anchor_sample_is_seeded_and_only_sampled_anchors_count():
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 256, (2, 40), generator=g),
        "loss_mask": torch.ones(2, 40, dtype=torch.bool),
        "attention_mask": torch.ones(2, 40, dtype=torch.long),
    }
    full = peagle_batch_index(batch, 3, 1.0, 1.0)
    half = peagle_batch_index(batch, 3, 1.0, 0.5)
    again = peagle_batch_index(batch, 3, 1.0, 0.5)
    assert all(torch.equal(half[k], again[k]) for k in half)
    assert torch.equal(half["ttt_counted"][0], full["ttt_counted"][0])  # slot 1: every anchor
    for k in (1, 2):
        kept = half["ttt_counted"][k].sum() / full["ttt_counted"][k].sum()
        assert 0.3 < kept < 0.7
        assert not (half["ttt_counted"][k] & ~full["ttt_counted"][k]).any()
    assert half["ttt_positions"].shape[1] < full["ttt_positions"].shape[1]


def captured(target, ids: torch.Tensor) -> dict:
    """`ids` [B,T] with the target's features, as a captured batch."""
    hs = target(ids, output_hidden_states=True).hidden_states
    return {
        "input_ids": ids,
        "aux_hidden": torch.cat([hs[i] for i in AUX], -1),
        "final_hidden": hs[-1],
        TOP: greedy_ids(target.get_output_embeddings(), hs[-1]),
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "attention_mask": torch.ones_like(ids),
    }


def test_briefly_trained_head_decodes_losslessly_and_is_accepted(target):
    """Trained on the target's own text (rigged: the text it then decodes) until its slots agree
    with the target, the head drafts chains that are accepted at every slot, and the output stays
    the target's own `generate`."""
    torch.manual_seed(0)
    v = target.config.vocab_size
    cfg = PEagleConfig(aux_layer_ids=AUX, parallel_tokens=3)
    head = PEagleHead.from_target(
        target, "tiny", cfg, torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    )
    assert head.mask_token_id == 2  # LlamaConfig's eos: no pad token
    prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(1))
    ref = target.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long),
                          max_new_tokens=40, do_sample=False)
    trainee = PEagleTrainee(head, target.get_output_embeddings().weight, 3, 0.8)
    batch = captured(target, ref)
    opt = torch.optim.AdamW(trainee.head.parameters(), lr=3e-3)
    for _ in range(60):
        loss = trainee(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    run = speculative_generate(target, peagle_drafter(head, target, [Chain(3)]), prompt, 40, Chain(3))
    assert run.tokens == ref[0, 6:].tolist()
    assert run.stats.mean_acceptance_length > 1.5
    assert all(n > 0 for n in run.stats.accepted_per_position), run.stats.accepted_per_position
