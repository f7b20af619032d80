"""The EAGLE-3 head: its TTT unroll sees exactly what a chain decoder sees, its folder round-trips,
and it refuses a target it was not trained for."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from conf.errors import UserError
from conf.kinds import Eagle3Config
from data_prep.states.capture import TOP, greedy_ids
from data_prep.target import load_target
from heads.eagle3 import model as eagle3
from heads.eagle3.model import Branches, Eagle3Head, branch_attention
from heads.folder import CONFIG_NAME
from heads.parts import NORM_FLAGS, default_aux_layer_ids, norm_flags, resolve_aux_layer_ids
from heads.window import near, window_fields
from tests.support.targets import build_tiny_target
from trainer.decoding.drafters import Eagle3Drafter
from trainer.kinds.eagle3 import Eagle3Trainee, ttt_attention_mask
from trainer.trainee import simulated_acceptance_length


def identity_vocab(vocab_size: int, keep: int):
    """The `keep` lowest target ids as the draft vocabulary."""
    d2t = torch.zeros(keep, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:keep] = True
    return d2t, t2d


@pytest.fixture(scope="module")
def tiny(tiny_model, tiny_llama_dir):
    model = tiny_model
    torch.manual_seed(0)
    d2t, t2d = identity_vocab(model.config.vocab_size, 3000)
    head = Eagle3Head.from_target(model, str(tiny_llama_dir), Eagle3Config(**ALL_OFF), d2t, t2d)
    return model, head


def aux_features(model, head, ids):
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in head.aux_layer_ids], dim=-1), hs[-1]


def test_ttt_mask_by_hand():
    m = ttt_attention_mask(torch.arange(3)[None], 3, 2)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    # Later steps computing positions 1 and 2 of 3: causal over the context, own branch after.
    m = ttt_attention_mask(torch.tensor([[1, 2]]), 3, 1)[0, 0].int().tolist()
    assert m == [[1, 1, 0, 1, 0], [1, 1, 1, 0, 1]]


@pytest.mark.parametrize("variants", [False, True], ids=["original", "norm-variants"])
def test_ttt_unroll_equals_chain_decoding(tiny, tiny_llama_dir, variants):
    """Step k of training at position t == the k-th chained draft step after verifying 0..t
    (with the norm variants too: the state fed back is the same in both)."""
    model, head = tiny
    if variants:
        head = variant_of(head, **dict.fromkeys(ALL_OFF, True))
    torch.manual_seed(1)
    ids = torch.randint(0, 3000, (1, 12))
    aux, _ = aux_features(model, head, ids)
    trainee = Eagle3Trainee(head, model.get_output_embeddings().weight, ttt_length=4, step_weight=0.8)
    with torch.no_grad():
        unrolled = [head.logits(hidden) for _, hidden, _, _ in trainee.unroll(aux, ids)]
        # Later steps on a subset of positions (a different count per row, so one row is
        # padded) give the same rows as the full unroll.
        keep = torch.zeros(2, 12, dtype=torch.bool)
        keep[0, [3, 7, 8]] = True
        keep[1, 5] = True
        for k, hidden, pos, valid in trainee.unroll(aux.expand(2, -1, -1), ids.expand(2, -1), keep):
            if k > 0:
                assert pos[0].tolist() == [3, 7, 8] and pos[1, valid[1]].tolist() == [5]
            torch.testing.assert_close(head.logits(hidden)[valid], unrolled[k][0, pos[valid]])
        for t in (3, 7):
            # Inference: step 0 over the verified prefix 0..t, then chain on position t alone.
            pos = torch.arange(t + 1)[None]
            hidden, logits, (k_cache, v_cache) = head.step(
                head.fuse(aux[:, : t + 1]), ids[:, 1 : t + 2], pos
            )
            torch.testing.assert_close(logits[:, t], unrolled[0][:, t], atol=1e-5, rtol=1e-4)
            hidden = hidden[:, t:]
            for k in range(1, 4):
                token = ids[:, t + 1 + k : t + 2 + k]
                hidden, logits, (kn, vn) = head.step(
                    hidden, token, torch.tensor([[t + k]]), None, (k_cache, v_cache)
                )
                k_cache, v_cache = torch.cat([k_cache, kn], 2), torch.cat([v_cache, vn], 2)
                torch.testing.assert_close(logits[:, 0], unrolled[k][:, t], atol=1e-5, rtol=1e-4)


def windowed(base: Eagle3Head, window: int) -> Eagle3Head:
    """`base` with its attention slid over the last `window` positions (`head.sliding_window`)."""
    head = Eagle3Head(LlamaConfig(**(base.config.to_dict() | window_fields(window, 1))), base.target)
    head.load_state_dict(base.state_dict())
    return head.eval()


def test_a_windowed_unroll_equals_windowed_chain_decoding(tiny):
    """`head.sliding_window`: step k of training at position t sees the context keys less than W
    before its own position t+k, as the chain decoder's cache mask slides over the same keys; the
    drafter takes the window from the head's config, and far from the start it changes the logits."""
    model, base = tiny
    w, n = 16, 40
    head = windowed(base, w)
    assert Eagle3Drafter(head).window == w and Eagle3Drafter(base).window is None
    ids = torch.randint(0, 3000, (1, n), generator=torch.Generator().manual_seed(2))
    aux, _ = aux_features(model, head, ids)
    steps = 4

    def unroll(h: Eagle3Head) -> list[torch.Tensor]:
        trainee = Eagle3Trainee(h, model.lm_head.weight, steps, 0.8)
        return [h.logits(hidden) for _, hidden, _, _ in trainee.unroll(aux, ids)]

    with torch.no_grad():
        unrolled, whole = unroll(head), unroll(base)
        for t in (9, 30):
            pos = torch.arange(t + 1)
            mask = (pos[None] <= pos[:, None]) & near(pos, pos, w)
            hidden, logits, (k_cache, v_cache) = head.step(
                head.fuse(aux[:, : t + 1]), ids[:, 1 : t + 2], pos[None], mask[None, None]
            )
            torch.testing.assert_close(logits[:, t], unrolled[0][:, t], atol=1e-5, rtol=1e-4)
            hidden = hidden[:, t:]
            for k in range(1, steps):
                mask = near(torch.tensor([t + k]), torch.arange(t + 1 + k), w)
                hidden, logits, (kn, vn) = head.step(
                    hidden, ids[:, t + 1 + k : t + 2 + k], torch.tensor([[t + k]]), mask[None, None],
                    (k_cache, v_cache),
                )
                k_cache, v_cache = torch.cat([k_cache, kn], 2), torch.cat([v_cache, vn], 2)
                torch.testing.assert_close(logits[:, 0], unrolled[k][:, t], atol=1e-5, rtol=1e-4)
    for k in range(steps):  # inside the window the same; beyond it not
        torch.testing.assert_close(unrolled[k][:, : w - k], whole[k][:, : w - k])
        assert not torch.allclose(unrolled[k][:, 30], whole[k][:, 30], atol=1e-4)


def test_a_window_that_cannot_hold_the_draft_is_one_line():
    with pytest.raises(UserError, match=r"^head.sliding_window=8: expected null or a number of positions"):
        Eagle3Config(sliding_window=8)
    with pytest.raises(UserError, match=r"^head.ttt_length=20: expected below head.sliding_window=16"):
        Eagle3Config(sliding_window=16, ttt_length=20)


def test_loss_is_finite_and_metrics_count_labels(tiny):
    model, head = tiny
    ids = torch.randint(0, 3000, (2, 10))
    aux, final = aux_features(model, head, ids)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 5:] = True
    trainee = Eagle3Trainee(head, model.get_output_embeddings().weight, ttt_length=3, step_weight=0.8)
    top = greedy_ids(model.get_output_embeddings(), final)
    out = trainee({"input_ids": ids, "loss_mask": mask, "aux_hidden": aux, "final_hidden": final, TOP: top})
    assert torch.isfinite(out["loss"])
    # label positions t+2+k in 5..9 -> positions t in 3-k..7-k: 5 per row at every step
    assert out["total"].tolist() == [10.0, 10.0, 10.0]


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)


def test_save_load_roundtrip(tiny, tmp_path, tiny_llama_dir):
    model, head = tiny
    head.save_pretrained(tmp_path / "h")
    again = Eagle3Head.from_pretrained(tmp_path / "h", model, str(tiny_llama_dir))
    ids = torch.randint(0, 3000, (1, 6))
    hidden = torch.randn(1, 6, 64)
    pos = torch.arange(6)[None]
    torch.testing.assert_close(head.step(hidden, ids, pos)[1], again.step(hidden, ids, pos)[1])
    assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)
    assert not (tmp_path / "h").with_name("h.tmp").exists()
    # Readable by an engine running as another user (mkdtemp alone would leave 0700 / 0600).
    assert oct((tmp_path / "h").stat().st_mode & 0o777) == "0o755"
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "h").iterdir()} == {"0o644"}


def test_refuses_other_target(tiny, tmp_path, smol_tokenizer):
    _, head = tiny
    head.save_pretrained(tmp_path / "h")
    other_dir = build_tiny_target(tmp_path / "other", "llama", smol_tokenizer, num_hidden_layers=6)
    other, _ = load_target(str(other_dir))
    with pytest.raises(UserError, match="num_hidden_layers 8 != 6"):
        Eagle3Head.from_pretrained(tmp_path / "h", other, str(other_dir))



def test_default_aux_layer_ids_are_distinct_on_any_target_of_three_layers_or_more():
    """The engines' default (2, N//2, N-3) from 7 layers on; below, where it collides (4 layers:
    2, 2, 1), distinct layer outputs every engine captures (1..N-1), the embeddings only at 3."""
    shallow = {3: [0, 1, 2], 4: [1, 2, 3], 5: [1, 3, 4], 6: [1, 3, 5]}
    for n in range(3, 81):
        ids = resolve_aux_layer_ids(None, n)
        assert ids == default_aux_layer_ids(n) == shallow.get(n, [2, n // 2, n - 3]), n
        assert len(set(ids)) == 3 and ids[-1] < n, n  # never the final norm's output (index N)
        assert ids[0] >= (1 if n >= 4 else 0), n
    assert resolve_aux_layer_ids([5, 1, 3], 6) == [1, 3, 5]  # the user's ids, sorted


@pytest.mark.parametrize(
    "ids, n, shown",
    [
        ([2, 2, 1], 4, "[2, 2, 1]"),
        ([1, 2, 9], 8, "[1, 2, 9]"),
        (None, 2, "[0, 1, 1] (the default for 2 layers)"),
    ],
)
def test_aux_layer_ids_error_names_the_main_jobs_override(ids, n, shown):
    """One line naming the ids and the override the main job takes (`head.aux_layer_ids`), not
    `head=`, which only `trainer.evaluate` has."""
    with pytest.raises(UserError) as err:
        resolve_aux_layer_ids(ids, n)
    msg = str(err.value)
    assert msg.startswith(f"head.aux_layer_ids={shown}: expected 3 distinct ids in 0..{n} ")
    assert msg.endswith("train with head.aux_layer_ids=[a, b, c]") and "head=" not in msg
    assert "\n" not in msg


# ---- layer variants (vLLM `llama_eagle3` / speculators flags) --------------------------------


def variant_of(base: Eagle3Head, **flags) -> Eagle3Head:
    """`base` with some norm flags on, built from the layer config as a folder's reader builds it
    (so norm_before_fc with fc_norm, which the training config refuses, is vLLM's too): every shared
    weight copied, the added norms' weights off 1.0 (ones would hide a misplaced norm's scale)."""
    head = Eagle3Head(LlamaConfig(**(base.config.to_dict() | flags)), base.target)
    missing, unexpected = head.load_state_dict(base.state_dict(), strict=False)
    added = [k for k in head.state_dict() if k.startswith(("input_norm.", "fc_norm."))]
    assert unexpected == [] and sorted(missing) == sorted(added)
    with torch.no_grad():
        for name in added:
            head.get_parameter(name).uniform_(0.5, 1.5)
    return head.eval()


def rms_norm_by_hand(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out (vLLM's `RMSNorm.forward_native`: float32 mean of squares)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_chain(head: Eagle3Head, aux, ids, flags: dict[str, bool]):
    """Fuse, one draft step over every position, then one chained step on the last: written out
    from vLLM 0.32 `llama_eagle3.py` (which sub-module sits where for each flag), using the head's
    own sub-modules so that the comparison is exact. Returns [fused feature, step 0's fed-back
    hidden, its logits, step 1's fed-back hidden, its logits]."""
    m, t = head.midlayer, ids.shape[1] - 1
    x = head.input_norm(aux) if flags["norm_before_fc"] else aux  # combine_hidden_states
    if flags["fc_norm"]:  # then one norm per aux layer's [Ht] slice, in the order of the ids
        ht, eps = head.config.target_hidden_size, head.config.rms_norm_eps
        slices = [x[..., i * ht : (i + 1) * ht] for i in range(len(head.fc_norm))]
        x = torch.cat([rms_norm_by_hand(c, n.weight, eps) for c, n in zip(slices, head.fc_norm)], dim=-1)
    feat = head.fc(x)

    def layer(hidden, tokens, pos, past):
        cos, sin = head.rotary(hidden, pos)
        normed = m.hidden_norm(hidden)
        residual = normed if flags["norm_before_residual"] else hidden  # _norm_before_residual
        x = torch.cat([m.input_layernorm(head.embed_tokens(tokens)), normed], dim=-1)
        attn, kv = m.self_attn(x, cos, sin, None, past)
        h = residual + attn
        h = h + m.mlp(m.post_attention_layernorm(h))
        post = head.norm(h)  # logits always read the normed state
        return (post if flags["norm_output"] else h), head.lm_head(post), kv  # aux_output

    h0, l0, kv = layer(feat, ids[:, 1:], torch.arange(t)[None], None)
    h1, l1, _ = layer(h0[:, -1:], ids[:, -1:], torch.tensor([[t]]), kv)
    return [feat, h0, l0, h1, l1]


def head_chain(head: Eagle3Head, aux, ids):
    """The same through the head's own API, as the decoder drives it."""
    t = ids.shape[1] - 1
    feat = head.fuse(aux)
    h0, l0, kv = head.step(feat, ids[:, 1:], torch.arange(t)[None])
    h1, l1, _ = head.step(h0[:, -1:], ids[:, -1:], torch.tensor([[t]]), None, kv)
    return [feat, h0, l0, h1, l1]


ALL_OFF = dict.fromkeys(NORM_FLAGS, False)


@pytest.mark.parametrize(
    "flags",
    [{}, {"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_fc": True, "fc_norm": True},
     {"norm_before_residual": True}, {"norm_output": True}, dict.fromkeys(ALL_OFF, True)],
    ids=["off", "norm_before_fc", "fc_norm", "both-fc-norms", "norm_before_residual", "norm_output", "all"],
)
def test_each_norm_sits_where_vllm_puts_it(tiny, flags):
    """Per flag: the head equals the engine's placement exactly, and differs from the flag-off head
    exactly in the outputs that flag reaches (fc input / residual / the state fed back)."""
    model, base = tiny
    head = variant_of(base, **flags)
    torch.manual_seed(2)
    ids = torch.randint(0, 3000, (1, 9))
    aux, _ = aux_features(model, head, ids[:, :-1])
    with torch.no_grad():
        got, want = head_chain(head, aux, ids), reference_chain(head, aux, ids, ALL_OFF | flags)
        off = head_chain(base.eval(), aux, ids)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    (feat, h0, l0, _, l1), (feat_off, h0_off, l0_off, _, l1_off) = got, off
    changes_fc_input = flags.get("norm_before_fc", False) or flags.get("fc_norm", False)
    assert torch.equal(feat, feat_off) != changes_fc_input
    # Step 0's logits move with anything before the final norm; norm_output alone keeps them.
    changes_step0 = changes_fc_input or flags.get("norm_before_residual", False)
    assert torch.equal(l0, l0_off) != changes_step0
    assert torch.equal(h0, h0_off) != (changes_step0 or flags.get("norm_output", False))
    if flags == {"norm_output": True}:  # the same layer, only the fed-back state is normed
        assert torch.equal(h0, base.norm(h0_off))
    assert torch.equal(l1, l1_off) == (flags == {})


def test_fc_norm_is_one_norm_per_aux_layer(tiny):
    """fc_norm scales each aux layer's slice by that slice's own RMS: a layer whose features are
    1000x larger reaches fc as it would at 1x (one norm over the concatenation does not)."""
    model, base = tiny
    head = variant_of(base, fc_norm=True)
    assert [tuple(n.weight.shape) for n in head.fc_norm] == [(head.config.target_hidden_size,)] * 3
    torch.manual_seed(3)
    ids = torch.randint(0, 3000, (1, 8))
    aux, _ = aux_features(model, head, ids)
    ht = head.config.target_hidden_size
    louder = aux.clone()
    louder[..., ht : 2 * ht] *= 1000.0
    with torch.no_grad():
        assert torch.allclose(head.fuse(louder), head.fuse(aux), atol=1e-3)  # eps aside
        one_norm = variant_of(base, norm_before_fc=True)  # one RMS over all three: no longer equal
        assert not torch.allclose(one_norm.fuse(louder), one_norm.fuse(aux), atol=1e-2)


def test_flags_off_adds_no_tensor(tiny):
    """The default head is the original layout: no input_norm, the same tensors as before."""
    _, head = tiny
    assert head.input_norm is None and head.fc_norm is None
    assert not any(k.startswith(("input_norm", "fc_norm")) for k in head.state_dict())


def test_folder_saved_before_fc_norm_reads_as_off(tiny, tmp_path, tiny_llama_dir):
    """A head folder written before the flag existed (no `fc_norm` in its config) loads with it
    off and computes what it computed."""
    model, base = tiny
    head = variant_of(base, norm_before_fc=True, norm_output=True)
    head.save_pretrained(tmp_path / "h")
    meta_file = tmp_path / "h" / CONFIG_NAME
    meta = json.loads(meta_file.read_text())
    del meta["config"]["fc_norm"]
    meta_file.write_text(json.dumps(meta))
    again = Eagle3Head.from_pretrained(tmp_path / "h", model, str(tiny_llama_dir))
    assert again.fc_norm is None and norm_flags(again.config)["fc_norm"] is False
    aux, _ = aux_features(model, head, torch.randint(0, 3000, (1, 8)))
    ids = torch.randint(0, 3000, (1, 9))
    with torch.no_grad():
        pairs = zip(head_chain(again.eval(), aux, ids), head_chain(head, aux, ids), strict=True)
        assert all(torch.equal(g, w) for g, w in pairs)


def test_norm_variant_folder_round_trip(tiny, tmp_path, tiny_llama_dir):
    model, base = tiny
    head = variant_of(base, **dict.fromkeys(ALL_OFF, True))
    head.save_pretrained(tmp_path / "h")
    again = Eagle3Head.from_pretrained(tmp_path / "h", model, str(tiny_llama_dir))
    assert norm_flags(again.config) == dict.fromkeys(ALL_OFF, True)
    assert torch.equal(again.input_norm.weight, head.input_norm.weight)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(again.fc_norm, head.fc_norm, strict=True))
    aux, _ = aux_features(model, head, torch.randint(0, 3000, (1, 8)))
    ids = torch.randint(0, 3000, (1, 9))
    with torch.no_grad():
        pairs = zip(head_chain(again, aux, ids), head_chain(head, aux, ids), strict=True)
        assert all(torch.equal(g, w) for g, w in pairs)


def test_norm_flags_refuse_non_bool_before_anything_loads():
    from conf.compose import compose_root

    assert compose_root(["+head=eagle3", "head.norm_output=true"]).head.norm_output is True
    # The two fc-input norms are one or the other (speculators refuses both, TensorRT-LLM would
    # apply only fc_norm): fc_norm turns norm_before_fc off unless both are asked for, which is
    # refused naming the override that fixes it.
    with pytest.raises(UserError, match=r"^head.fc_norm=True: .*drop head.norm_before_fc=true, or set it"):
        compose_root(["+head=eagle3", "head.fc_norm=true", "head.norm_before_fc=true"])
    both = ["+head=eagle3", "head.fc_norm=true", "head.norm_before_fc=false"]
    assert compose_root(both).head == compose_root(["+head=eagle3", "head.fc_norm=true"]).head
    for flag in ALL_OFF:
        with pytest.raises(UserError, match=f"{flag}: Value 'maybe' is not a valid bool"):
            compose_root(["+head=eagle3", f"head.{flag}=maybe"])


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("step", [1, 3])
def test_branch_attention_equals_attention_over_the_whole_ttt_mask(step, chunked, monkeypatch):
    """A later TTT step's attention (`Branches`: the context under its mask, then one key per
    earlier step on the query's own row) equals SDPA over every key under `ttt_attention_mask`,
    values and gradients, with grouped K/V heads and two documents packed in a row; so does the
    long-context path, in chunks of query rows each recomputed in the backward pass."""
    if chunked:  # 2 rows of 2x6x7 scores a chunk: the 5 rows in 3 chunks
        monkeypatch.setattr(eagle3, "BRANCH_SCORES", 2 * 2 * 6 * 7)
    g = torch.Generator().manual_seed(step)
    b, heads, groups, t, d = 2, 6, 2, 7, 8
    pos = torch.tensor([[0, 2, 3, 5, 6], [1, 2, 4, 5, 6]])
    starts = torch.tensor([[0, 0, 0, 4, 4], [0, 0, 0, 0, 0]])  # row 0: documents 0-3 and 4-6
    s = pos.shape[1]
    q = torch.randn(b, heads, s, d, generator=g, requires_grad=True)
    context = [torch.randn(b, groups, t, d, generator=g, requires_grad=True) for _ in range(2)]
    steps = [
        tuple(torch.randn(b, groups, s, d, generator=g, requires_grad=True) for _ in range(2))
        for _ in range(step)
    ]
    leaves = [q, *context, *(x for kv in steps for x in kv)]
    past = Branches(tuple(context), ttt_attention_mask(pos, t, 0, starts), tuple(steps[:-1]))
    out = branch_attention(q, *steps[-1], past)
    out.square().sum().backward()
    got = [x.grad for x in leaves]
    for x in leaves:
        x.grad = None
    keys = torch.cat([context[0]] + [k for k, _ in steps], 2)
    values = torch.cat([context[1]] + [v for _, v in steps], 2)
    mask = ttt_attention_mask(pos, t, step, starts)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got, [x.grad for x in leaves]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
