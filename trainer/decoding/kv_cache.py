"""The target's KV cache while decoding one request: one forward over new tokens against a
DynamicCache, then keep only the tokens that were accepted. (Not the GGUF conversion cache of
`data_prep.target`: this one lives for one request, in memory.)

Chains are plain causal forwards and are undone by cropping the cache; trees are one forward with
a tree attention mask and tree position ids, after which the accepted path's K/V are gathered.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from trainer.decoding.tree import additive_mask, tree_attention_mask, tree_position_ids, with_prefix


class TargetKV:
    """A target model with its KV cache for one request; `length` tokens are committed."""

    def __init__(self, model, hidden_layers: list[int]):
        self.model = model
        self.hidden_layers = list(hidden_layers)
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self._pending = 0
        self.device = model.get_input_embeddings().weight.device
        # transformers 5 renamed `past_key_values` to `cache` (the old name warns on each call).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run and commit the whole prompt [T]: logits [1, V] of its last token, hidden states
        [T, H] of every prompt token (a drafter reads them all)."""
        out = self.forward(prompt, last_only=True)
        self.keep(list(range(prompt.numel())))
        return out

    @torch.no_grad()
    def forward(
        self, tokens: torch.Tensor, parents: list[int] | None = None, last_only: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run tokens [T] after the committed prefix; parents None = a causal chain.

        Returns logits [T, V] ([1, V] with last_only) and, per requested hidden-state index,
        [T, H] features. The new tokens sit in the cache until `keep` decides which stay.
        """
        if self._pending:
            raise RuntimeError("keep() must follow every forward()")
        kwargs = {self.cache_kwarg: self.cache}
        if parents is not None:
            local = tree_attention_mask(parents).to(self.device)
            mask = with_prefix(local, self.length)
            kwargs["attention_mask"] = additive_mask(mask, self.model.dtype)
            kwargs["position_ids"] = tree_position_ids(parents, self.length).to(self.device)[None]
        out = self.model(
            tokens[None].to(self.device),
            use_cache=True,
            output_hidden_states=bool(self.hidden_layers),
            logits_to_keep=1 if last_only else 0,
            **kwargs,
        )
        self._pending = tokens.numel()
        hidden = [out.hidden_states[i][0] for i in self.hidden_layers]
        return out.logits[0], hidden

    def keep(self, path: list[int]) -> None:
        """Commit the last forward's tokens at indices `path` (ascending, in order)."""
        n, t = len(path), self._pending
        self._pending = 0
        if path != list(range(n)):
            index = torch.tensor(path, device=self.device) + self.length
            end = self.length + n
            for layer in self.cache.layers:
                layer.keys[:, :, self.length : end] = layer.keys[:, :, index]
                layer.values[:, :, self.length : end] = layer.values[:, :, index]
        self.cache.crop(n - t)
        self.length += n
