"""CUDA graphs for the decoder's fixed-shape steps (target greedy and verify forwards, draft steps).

At batch 1 a small model's forward is a few hundred short kernels, and on a GPU the host that
launches them (Python, the transformers modules, the allocator) sets the pace, not the GPU. A CUDA
graph records those launches once and replays them with one call. A graph replays fixed memory:
its inputs are copied into tensors it owns, it writes its outputs to tensors it owns, and it reads
and writes the static KV caches in place. The static caches (`kv_cache.StaticCache`) make every
step of a given width the same shapes, so one graph per width serves a whole run.

On any other device the steps run eagerly, through the very same functions, and so does a step
that cannot be captured (`StepGraphs`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from conf.errors import first_line

# Eager calls before capture, on a side stream, as PyTorch's CUDA graph notes ask: lazy
# initialisation (cuBLAS handles, kernel selection, caching-allocator pools) must not be captured.
WARMUP = 3


def graphs_enabled(device: torch.device) -> bool:
    """Only CUDA replays graphs; a CPU decode stays eager (and is what the lossless tests run)."""
    return device.type == "cuda"


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: object


class StepGraphs:
    """Runs `fn(*inputs)` eagerly, or, on CUDA, replays one CUDA graph per (key, input shapes).

    `fn` must be a function of its tensor inputs and of state kept at fixed addresses (weights,
    static caches): no host reads of GPU values, no shapes that depend on data. The outputs are
    the graph's own tensors, overwritten by the next replay of the same graph: read them (or copy
    what must last) before calling that step again.

    A step whose capture fails runs eagerly from then on, under every input shape, after one line
    on stderr (the first failure of this `StepGraphs`): transformers' MoE expert loops (gpt-oss,
    Qwen3-MoE) call `nonzero`, a host read that CUDA refuses while a stream captures ("operation
    not permitted when stream is capturing"), and such a target still decodes, only slower.
    `capture`: what records a graph (`_capture`; a test without CUDA makes one that fails).
    """

    def __init__(self, device: torch.device, capture: Callable[..., _Graph] | None = None):
        self.enabled = graphs_enabled(device)
        self._capture = _capture if capture is None else capture
        self._graphs: dict[Hashable, _Graph] = {}
        self._eager: set[Hashable] = set()

    def __call__(self, key: Hashable, fn: Callable, *inputs: torch.Tensor):
        if not self.enabled or key in self._eager:
            return fn(*inputs)
        full_key = (key, *((tuple(t.shape), t.dtype) for t in inputs))
        entry = self._graphs.get(full_key)
        if entry is None:
            try:
                entry = self._capture(fn, inputs)
            except Exception as err:  # any capture failure; a fault of `fn` itself re-raises eagerly
                self._run_eagerly(key, err)
                return fn(*inputs)
            self._graphs[full_key] = entry
        else:
            for static, value in zip(entry.inputs, inputs):
                static.copy_(value)
        entry.graph.replay()
        return entry.outputs

    def _run_eagerly(self, key: Hashable, err: Exception) -> None:
        if not self._eager:
            print(f"cuda graphs: step {key!r} cannot be captured ({first_line(err)}); it runs eagerly",
                  file=sys.stderr)
        self._eager.add(key)

    def clear(self) -> None:
        """Forget every graph: the buffers they read were reallocated. Steps that cannot be
        captured stay eager: that is their code's nature, not their buffers'."""
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)


def _capture(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> _Graph:
    """Warm `fn` up on a side stream, then record it reading static copies of `inputs`.

    The warm-up calls run for real on the very inputs of this call: a step writes the same K/V
    at the same cache slots on every run, so the replay that follows repeats them harmlessly.
    `thread_local` capture only forbids this thread's unsafe CUDA calls, so a data loader's pin
    thread (decoded validation during training) does not break the capture.

    A capture that raises leaves no stream capturing and the caller's stream current: torch's
    `torch.cuda.graph.__exit__` (torch/cuda/graphs.py, torch 2.13) runs on the exception too and
    calls `capture_end()` before restoring the stream; but when the capture was invalidated (the
    refused `nonzero`) `capture_end`'s `cudaStreamEndCapture` itself raises and the stream context
    is never exited, so the caller's stream is put back here. What the failed capture recorded
    never ran, and the warm-up already made the step's cache writes, which an eager rerun repeats.
    """
    static = tuple(t.clone() for t in inputs)
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn(*static)
    caller.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = fn(*static)
    except Exception:
        torch.cuda.set_stream(caller)
        raise
    return _Graph(graph, static, outputs)
