"""Shared pieces of the decoder tests: tiny "chaotic" targets, random and partly right drafters,
an EAGLE-3 head stepped by hand, and a chi-square test for sampled tokens.

A tiny target with the default init repeats one token forever, which would let a broken decoder
pass a token-for-token comparison; a larger init gives varied, context-dependent greedy text.
"""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from conf.kinds import Eagle3Config, MedusaConfig
from heads.eagle3.model import Eagle3Head
from heads.medusa.model import MedusaHead
from trainer.decoding import (
    Chain,
    Draft,
    MedusaDrafter,
    OracleDrafter,
    Tree,
)


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root down to `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def chaotic_target(family: str = "llama", vocab: int = 256, seed: int = 0, layers: int = 4):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def random_eagle3_head(model, draft_vocab: int | None = None, seed: int = 0) -> Eagle3Head:
    """A fresh head; with `draft_vocab`, a reduced vocabulary of every other target id."""
    v = model.config.vocab_size
    torch.manual_seed(seed)
    if draft_vocab is None:
        d2t, t2d = torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    else:
        ids = torch.arange(0, 2 * draft_vocab, 2)
        d2t, t2d = ids - torch.arange(draft_vocab), torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
    first = max(model.config.num_hidden_layers - 3, 0)
    cfg = Eagle3Config(aux_layer_ids=[first, first + 1, first + 2])
    return Eagle3Head.from_target(model, "tiny", cfg, d2t, t2d).eval().requires_grad_(False)


class NoisyOracle:
    """Right for a random number of leading positions, then wrong. In tree mode the right line
    sits at a random place among wrong siblings, so accepted paths are not index prefixes."""

    hidden_layers: list[int] = []

    def __init__(self, model, seed: int = 0):
        self.oracle, self.rng = OracleDrafter(model), random.Random(seed)
        self.vocab = model.config.vocab_size

    def start(self, prompt, hidden, next_token):
        self.oracle.start(prompt, hidden, next_token)

    def commit(self, tokens, hidden, next_token):
        self.oracle.commit(tokens, hidden, next_token)

    def propose(self, shape, sampling) -> Draft:
        n = shape.k if isinstance(shape, Chain) else shape.depth
        truth = self.oracle.propose(Chain(n), sampling).tokens.tolist()
        cut = self.rng.randint(0, n)
        line = [t if i < cut else (t + 1) % self.vocab for i, t in enumerate(truth)]
        if isinstance(shape, Chain):
            return Draft(torch.tensor(line))
        tokens, parents, on_line = [], [-1], 0
        for level, token in enumerate(line):
            wrong = (truth[level] + 2) % self.vocab
            pair = [(token, True), (wrong, False)]
            self.rng.shuffle(pair)
            parent, on_line = on_line, None
            for tok, right in pair:
                tokens.append(tok)
                parents.append(parent)
                if right:
                    on_line = len(parents) - 1
        return Draft(torch.tensor(tokens), parents)


SHAPES = [Chain(3), Tree(total_tokens=10, depth=4, topk=3, choices=((0,), (1,), (0, 0), (0, 1)))]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 draws are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def position_sensitive_head(target, **kw):
    """A random head whose output leans on attention (large q/k/o), so that a wrong mask or
    position changes its top-k instead of hiding behind the residual stream."""
    head = random_eagle3_head(target, **kw)
    attn = head.midlayer.self_attn
    for proj, scale in ((attn.q_proj, 4.0), (attn.k_proj, 4.0), (attn.o_proj, 20.0)):
        proj.weight.data.mul_(scale)
    return head


def features(target, head, seq: torch.Tensor) -> list[torch.Tensor]:
    hs = target(seq[None], output_hidden_states=True).hidden_states
    return [hs[i][0] for i in head.aux_layer_ids]


def from_scratch(target, head, seq: torch.Tensor, nxt: int):
    """Step 0 over the whole verified sequence at once, no cache: (hidden, logits, K/V)."""
    following = torch.cat([seq[1:], torch.tensor([nxt])])
    fused = head.fuse(torch.cat(features(target, head, seq), -1))[None]
    return head.step(fused, following[None], torch.arange(seq.numel())[None])


def chain_logits(head, hidden, kv, start: int, tokens: list[int]) -> torch.Tensor:
    """Draft logits after feeding `tokens` one by one from the pre-norm `hidden`, no tree."""
    past, logits = kv, None
    for j, tok in enumerate(tokens):
        hidden, logits, new = head.step(hidden, torch.tensor([[tok]]), torch.tensor([[start + j]]),
                                        None, past)
        past = (torch.cat([past[0], new[0]], 2), torch.cat([past[1], new[1]], 2))
    return logits[0, -1]


def medusa_drafter(model):
    head = MedusaHead.from_target(model, "tiny", MedusaConfig(num_heads=4))
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    return MedusaDrafter(head.eval(), model.config.num_hidden_layers)
