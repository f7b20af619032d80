"""Shared pieces of the decoder tests: tiny "chaotic" targets and a partly right drafter.

A tiny target with the default init repeats one token forever, which would let a broken decoder
pass a token-for-token comparison; a larger init gives varied, context-dependent greedy text.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from conf.schema import Eagle3Config
from heads.eagle3 import Eagle3Head
from trainer.decoding import Chain, Draft, OracleDrafter, Tree


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


@pytest.fixture(scope="module")
def single_thread():
    """2 shared cores: one torch thread is several times faster than two fighting for them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
