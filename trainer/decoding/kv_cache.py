"""The KV caches of one decode: the target's (`TargetKV`) and the EAGLE-3 head's, both a
`StaticCache`. (Not the GGUF conversion cache of `data_prep.target`: these live in memory.)

A static cache is allocated once and written at given slots; every forward reads all of it through
an explicit mask of the slots each new token may see. Rolling back rejected drafts is then a change
of the committed length (a tree's accepted path is first gathered into place), and a forward of T
new tokens has the same shapes at any length, so on CUDA one graph per width replays it
(`graphs.py`). Chains and trees run the same way: a chain is a causal mask among the new tokens,
a tree its ancestor mask with tree position ids. A target's sliding-window layers read a mask of
their own that also hides what lies outside their window (`data_prep.masks.AttentionLayout`), so
the cache keeps every position on every layer and still computes what transformers does.
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial

import torch
import torch.nn.functional as F

from data_prep.masks import additive_mask, attention_layout
from data_prep.target import input_device
from heads.window import near
from trainer.decoding.graphs import StepGraphs
from trainer.decoding.tree import tree_attention_mask, tree_position_ids, with_prefix


def capacity_for(n: int, graphed: bool) -> int:
    """Slots to allocate for `n` tokens. Graphs are recorded against the buffers, so with them the
    next power of two, at least 1024: an evaluation's requests (chat prompts and a few hundred
    new tokens) then share one size, captured at its warm-up, and a GPU reads the idle slots far
    faster than the weights. Eager, n rounded up to 64: every slot is attended, and a CPU pays
    for each."""
    if graphed:
        return max(1024, 1 << (n - 1).bit_length())
    return -(-n // 64) * 64


class StaticCache:
    """K/V buffers [1, kv_heads, capacity, head_dim] per layer, in the shape of a transformers
    `Cache`: attention layers call only `update`, which writes the new K/V at `slots` and returns
    the whole buffers; the mask passed with the forward hides what a token may not see (older
    drafts, stale slots, zeros). The buffers are allocated on the first update, from the K/V the
    model hands over, so heads, head size, dtype and device are the model's own."""

    def __init__(self):
        self.capacity = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slots: torch.Tensor | None = None  # where the next forward's K/V go
        self.owner: object | None = None  # the request writing it (see TargetKV)

    def reserve(self, capacity: int, keep: int) -> bool:
        """Grow to `capacity` slots if smaller, keeping the first `keep`. True when the buffers
        moved: graphs recorded against the old ones are stale."""
        if capacity <= self.capacity:
            return False
        self.capacity = capacity
        for store in (self.keys, self.values):
            for layer, old in store.items():
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                new[:, :, :keep] = old[:, :, :keep]
                store[layer] = new
        return True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V [1, heads, T, dim] at `slots`; return every slot."""
        if layer_idx not in self.keys:  # values may differ from keys in width (MLA's latents)
            self.keys[layer_idx] = key_states.new_zeros(
                1, key_states.shape[1], self.capacity, key_states.shape[3]
            )
            self.values[layer_idx] = value_states.new_zeros(
                1, value_states.shape[1], self.capacity, value_states.shape[3]
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys, values

    def gather(self, index: torch.Tensor, start: int) -> None:
        """Copy the entries at slots `index` (ascending) to slots start, start+1, ...: a tree's
        accepted path moves into place after the committed prefix."""
        end = start + index.numel()
        for store in (self.keys, self.values):
            for tensor in store.values():
                tensor[:, :, start:end] = tensor[:, :, index]

    def keep(self, local: torch.Tensor, prefix: int) -> torch.Tensor:
        """bool [1, 1, T, capacity] for T new tokens: each sees the `prefix` committed slots, and
        the n slots after them as `local` [T, n] says (the last T of those are the new tokens'
        own); nothing else."""
        return F.pad(with_prefix(local, prefix), (0, self.capacity - prefix - local.shape[1]))

    def mask(self, local: torch.Tensor, prefix: int, dtype: torch.dtype, window: int | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        """`keep` as an additive mask: what a model whose every layer sees all it keeps reads.
        With a `window`, a query at position p (`positions`, one per new token) sees slot i only
        at distances p - i below it, as transformers slides: slot i holds position i in the
        committed prefix and in a chain's new tokens (a prompt's first forward), and a position
        at most i in a tree's, whose few nodes lie within any window."""
        keep = self.keep(local, prefix)
        if window is not None:
            n = prefix + local.shape[1]
            keep[..., :n] &= near(positions.reshape(-1), torch.arange(n, device=keep.device), window)
        return additive_mask(keep, dtype)


def slot_positions(prefix: int, positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """long [capacity]: the position whose K/V each slot holds during a forward of new tokens at
    `positions` [T]: the committed prefix in order (slot i, position i: a tree's accepted path is
    gathered into place), then the new tokens'; the slots after them hold nothing a mask lets be
    seen (0)."""
    held = torch.cat([torch.arange(prefix), positions])
    return F.pad(held, (0, capacity - held.numel()))


def causal(n: int, device: torch.device | None = None) -> torch.Tensor:
    """bool [n, n]: a chain, each token sees those before it and itself."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


# On CUDA the cache and the step graphs of a target outlive a request: capturing costs more than a
# short request. Keyed weakly by the model (nothing here refers back to it), and by its weights'
# address and dtype, which a graph has recorded.
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cache_and_graphs(model, device: torch.device) -> tuple[StaticCache, StepGraphs]:
    graphs = StepGraphs(device)
    if not graphs.enabled:
        return StaticCache(), graphs
    weight = model.get_input_embeddings().weight
    key = (weight.data_ptr(), weight.dtype)
    shared = _SHARED.get(model)
    if shared is None or shared[0] != key:
        shared = _SHARED[model] = (key, StaticCache(), graphs)
    return shared[1], shared[2]


class TargetKV:
    """A target model with its KV cache for one request; `length` tokens are committed.

    `room`: the tokens the request may hold (prompt, answer and one draft), reserved at once so
    that the cache does not grow, and graphs are not captured again, mid-request. On CUDA the
    cache is the model's (see `_SHARED`), so one request per model runs at a time.
    """

    def __init__(self, model, hidden_layers: list[int], room: int = 0):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.device = input_device(model)
        self.layout = attention_layout(model.config)  # refuses a target it cannot mask
        self.cache, self.graphs = _cache_and_graphs(model, self.device)
        self.cache.owner = self._token = object()
        self.length = 0
        self._pending = 0
        # transformers 5 renamed `past_key_values` to `cache` (the old name warns on each call).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._reserve(room)

    def _reserve(self, n: int) -> None:
        if self.cache.reserve(capacity_for(n, self.graphs.enabled), keep=self.length):
            self.graphs.clear()

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run and commit the whole prompt [T] (eagerly: its length is the request's own): logits
        [1, V] of its last token, hidden states [T, H] of every prompt token (a drafter reads
        them all)."""
        out = self._run(prompt, None, keep=1, graphed=False)
        self.keep(list(range(prompt.numel())))
        return out

    def forward(
        self, tokens: torch.Tensor, parents: list[int] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run tokens [T] after the committed prefix; parents None = a causal chain.

        Returns logits [T, V] and, per requested hidden-state index, [T, H] features; on CUDA
        they are a graph's outputs, valid until the next forward. The new tokens sit in the cache
        until `keep` decides which stay.
        """
        return self._run(tokens, parents, keep=0, graphed=True)

    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, parents: list[int] | None, keep: int, graphed: bool):
        if self._pending:
            raise RuntimeError("keep() must follow every forward()")
        if self.cache.owner is not self._token:
            raise RuntimeError("another request on this model has taken over its KV cache")
        n, start = tokens.numel(), self.length
        self._reserve(start + n)
        if parents is None:
            local, positions = causal(n), torch.arange(start, start + n)
        else:
            local, positions = tree_attention_mask(parents), tree_position_ids(parents, start)
        distance = None  # batch 1 pays for every small op: only a sliding layer reads it
        if self.layout.sliding:
            distance = positions[:, None] - slot_positions(start, positions, self.cache.capacity)[None]
        masks = self.layout.masks(self.cache.keep(local, start), distance, self.model.dtype)
        inputs = [
            t.to(self.device) for t in (tokens[None], positions[None], masks, torch.arange(start, start + n))
        ]
        step = partial(self._step, keep=keep)
        out = self.graphs(("target", self.hidden_layers, keep), step, *inputs) if graphed else step(*inputs)
        self._pending = n
        return out

    def _step(self, ids, positions, masks, slots, keep: int):
        """The forward a graph records: inputs on the device (`masks`: one per kind of layer, see
        `AttentionLayout.masks`), K/V written at `slots`."""
        self.cache.slots = slots
        out = self.model(
            ids,
            position_ids=positions,
            attention_mask=self.layout.argument(masks),
            use_cache=True,
            output_hidden_states=bool(self.hidden_layers),
            logits_to_keep=keep,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[0], [out.hidden_states[i][0] for i in self.hidden_layers]

    def keep(self, path: list[int]) -> None:
        """Commit the last forward's tokens at indices `path` (ascending, in order); the others
        are left behind the committed length, to be overwritten."""
        n = len(path)
        self._pending = 0
        if path != list(range(n)):
            self.cache.gather(torch.tensor(path, device=self.device) + self.length, self.length)
        self.length += n
