"""Decode attention on a CPU that reads the KV cache once: one query token per row against that
row's own cached positions, for the regeneration engine's decode steps.

PyTorch's CPU attention runs a decode step as hundreds of tiny GEMMs (3 grouped queries x 64 per
KV head and row): it reads the cache at a fraction of the speed one core streams, and it reads
every row to the batch's longest width, so about half of what it reads is masked out.
Regeneration spent about as long in attention as in all its matmuls. This kernel reads each
row's keys and values once, only up to the row's own length, each key and value for all the
queries that share its KV head (64 rows to width 300: 1.5 ms against PyTorch's 3.9; one engine
1.5x faster, 2026-12-01). On a
sliding-window layer (Mistral, Gemma 3, ...) a row reads only the last `window` positions, as
transformers' mask lets it; attention with more than a softmax over scores (gpt-oss sinks,
soft-capping) stays PyTorch's.

It is a short C function compiled on first use with the system's C compiler (`cc -O3 -march=native`)
into the draftsmith cache (once, under a lock, however many runs start together) and loaded
through ctypes, which releases the GIL, so the engine's worker threads run it side by side.
Without a compiler `kernel()` is None and the engine keeps PyTorch's attention: same answers,
slower. float32 queries and keys (what a CPU target decodes in), values float32 or bf16 (with
bf16 linears a value leaves its projection as a bf16 number, and the engine stores it so: a
quarter fewer bytes per step, the same answers); a GPU never comes here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import string
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conf.files import build_once, lock_path
from data_prep.linears import cpu_flags
from data_prep.masks import AttentionLayout, attention_layout
from data_prep.target import cache_root

# One body, instantiated for float32 values and for bf16 ones (`SlotCache(value_dtype=)`): a bf16
# value is the top half of a float32's bits, so widening it is a shift; and for the common head
# dimensions as constants (`_DIMS`), where each query's output sums in registers over the row's
# positions (2.8 -> 2.1 ms at 128 rows, 3 KV heads of 3 queries, 100-400 positions, bf16 values;
# about what one core streams), with one copy for any other dimension. The names after `$` are
# filled in by `string.Template`.
_BODY = string.Template(r"""
/* out[r, h*group + j, :] = softmax(scale * q[r, h*group + j] . k[r, h, start[r]:count[r]])
 *                          @ v[r, h, start[r]:count[r]] */
int $name(const float *restrict q, const float *restrict k, const $elem *restrict v,
          float *restrict out, const int64_t *restrict start, const int64_t *restrict count,
          int64_t rows, int64_t kv_heads, int64_t group, int64_t dim, int64_t q_row,
          int64_t q_head, int64_t kv_row, int64_t kv_head, int64_t kv_pos, float scale,
          int64_t max_count) {
    float *scores = malloc(sizeof(float) * group * max_count);
    if (!scores) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = count[r] - start[r];
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *Q = q + r * q_row + h * group * q_head;
            const float *K = k + r * kv_row + h * kv_head + start[r] * kv_pos;
            const $elem *V = v + r * kv_row + h * kv_head + start[r] * kv_pos;
            float *O = out + (r * kv_heads + h) * group * $dim;
            for (int64_t w = 0; w < n; w++) {
                const float *kw = K + w * kv_pos;
                for (int64_t j = 0; j < group; j++) {
                    const float *qj = Q + j * q_head;
                    float acc = 0.f;
                    for (int64_t d = 0; d < $dim; d++) acc += qj[d] * kw[d];
                    scores[j * n + w] = acc * scale;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *s = scores + j * n, top = s[0], total = 0.f;
                for (int64_t w = 1; w < n; w++) top = s[w] > top ? s[w] : top;
                for (int64_t w = 0; w < n; w++) total += (s[w] = expf(s[w] - top));
                for (int64_t w = 0; w < n; w++) s[w] /= total;
                float o[$dim];
                for (int64_t d = 0; d < $dim; d++) o[d] = 0.f;
                for (int64_t w = 0; w < n; w++) {
                    const $elem *vw = V + w * kv_pos;
                    for (int64_t d = 0; d < $dim; d++) o[d] += s[w] * $load(vw[d]);
                }
                for (int64_t d = 0; d < $dim; d++) O[j * $dim + d] = o[d];
            }
        }
    }
    free(scores);
    return 0;
}
""")
# The kernel per value dtype: its name, the C type of a value, and how a value is read as a float.
_VALUES = {torch.float32: ("decode_attention", "float", "same"),
           torch.bfloat16: ("decode_attention_bf16", "uint16_t", "widen")}
_DIMS = (64, 128, None)  # head dimensions with a copy of their own (None: any other)


def _name(dtype: torch.dtype, dim: int | None) -> str:
    return f"{_VALUES[dtype][0]}_{dim or 'any'}"


_SOURCE = (
    r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float same(float x) { return x; }
static inline float widen(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
"""
    + "".join(_BODY.substitute(name=_name(dtype, dim), elem=elem, load=load, dim=dim or "dim")
              for (dtype, (_, elem, load)), dim in itertools.product(_VALUES.items(), _DIMS))
)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared"]
if platform.machine().lower() in ("x86_64", "amd64"):  # 512-bit vectors where the CPU has them: -6%
    _FLAGS.append("-mprefer-vector-width=512")
_I64 = ctypes.c_int64


def _compile(compiler: str, path: Path) -> Path:
    """Build the kernel into `path`, through a temporary name: a reader never loads half a file."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = os.path.join(tmp, "k.c"), os.path.join(tmp, "k.so")
        with open(src, "w") as fh:
            fh.write(_SOURCE)
        subprocess.run([compiler, *_FLAGS, src, "-o", lib, "-lm"], check=True, capture_output=True)
        os.replace(lib, path)
    return path


@functools.cache
def kernel() -> dict[tuple[torch.dtype, int | None], Callable[..., int]] | None:
    """The compiled kernels by value dtype and head dimension (None: any other), or None where
    no C compiler is found or it fails (PyTorch's attention is used instead). Built once per
    source, flags and machine, into the draftsmith cache, by one process at a time: runs started
    together compile it once (`conf.files.build_once`)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    # -march=native code runs only on a CPU with the same instruction set: the flags are in the key.
    build = "\0".join([_SOURCE, *_FLAGS, platform.machine(), cpu_flags()])
    key = hashlib.sha256(build.encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"decode_attention-{key}.so"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        what, found = f"decode-attention kernel {path}", lambda: path if path.exists() else None
        build_once(lock_path(path), what, found, lambda: _compile(compiler, path))
        library = ctypes.CDLL(str(path))
        functions = {(dtype, dim): getattr(library, _name(dtype, dim))
                     for dtype, dim in itertools.product(_VALUES, _DIMS)}
    except (OSError, AttributeError, subprocess.CalledProcessError):
        return None
    for fn in functions.values():
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [_I64] * 9 + [ctypes.c_float, _I64]
    return functions


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel can take this call: float32 query and keys on a CPU, float32 or bf16
    values laid out as the keys (MLA's expanded keys and values differ in width and strides:
    DeepSeek-V3's run on the model's own attention), the head dimension contiguous."""
    return (
        kernel() is not None
        and query.device.type == "cpu"
        and query.dtype == key.dtype == torch.float32
        and value.dtype in _VALUES
        and key.shape == value.shape
        and key.stride() == value.stride()
        and key.stride(-1) == 1
    )


def window_starts(counts: torch.Tensor, window: int | None) -> torch.Tensor:
    """The first position each row attends to: 0, or on a sliding layer the oldest of the last
    `window` positions (transformers' `sliding_window_overlay`)."""
    return (counts - window).clamp_min(0) if window is not None else torch.zeros_like(counts)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """query [rows, heads, 1, dim]; key, value [rows, kv_heads, >= max(counts), dim] with the same
    strides (views of a slot cache; values float32 or bf16); counts [rows]: row r attends to its
    first counts[r] positions, or with a `window` only to the last `window` of them. Returns
    [rows, 1, heads, dim], the layout a transformers attention function returns."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    if key.stride() != value.stride() or query.stride(-1) != 1:
        raise ValueError("decode_attention: key and value must share strides, dims contiguous")
    counts = counts.to(torch.int64).contiguous()
    longest = int(counts.max())
    if int(counts.min()) < 1 or longest > key.shape[2]:
        raise ValueError(f"decode_attention: counts must lie in 1..{key.shape[2]}")
    starts = window_starts(counts, window).contiguous()
    out = query.new_empty(rows, 1, heads, dim)
    kernels = kernel()
    failed = kernels.get((value.dtype, dim), kernels[value.dtype, None])(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), starts.data_ptr(),
        counts.data_ptr(),
        rows, kv_heads, heads // kv_heads, dim,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        scale, longest,
    )
    if failed:
        raise MemoryError("decode_attention: out of memory for the scores")
    return out


def _dispatching(original: str, layout: AttentionLayout):
    """A transformers attention function: decode calls that carry `slot_counts` (and that the
    kernel supports) run on the kernel, over each layer's window in `layout`; every other call
    (prefill, and attention the kernel does not compute: gpt-oss sinks, logit soft-capping) on
    the model's own `original`."""
    fallback = ALL_ATTENTION_FUNCTIONS[original]

    def attention(module, query, key, value, attention_mask, scaling=None, slot_counts=None, **kwargs):
        plain = kwargs.get("s_aux") is None and kwargs.get("softcap") is None
        if slot_counts is not None and plain and query.shape[2] == 1 and supported(query, key, value):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            window = layout.windows[module.layer_idx]
            return decode_attention(query, key, value, slot_counts, scale, window), None
        value = value.to(query.dtype)  # bf16 values are widened for PyTorch's attention
        return fallback(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    return attention


def applies(model) -> bool:
    """Whether the engine's decode steps run on the kernel for `model`: a float32 target on a CPU,
    on a registered attention (a model on `eager`, each architecture's own, keeps it), and a
    compiler at hand."""
    weight = model.get_input_embeddings().weight
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and model.config._attn_implementation in ALL_ATTENTION_FUNCTIONS
        and kernel() is not None
    )


@contextmanager
def slot_attention(model) -> Iterator[bool]:
    """Within: the model's attention takes `slot_counts` (see `_dispatching`). Yields `applies`;
    when False nothing changes and the caller must not pass `slot_counts`. The model's setting is
    restored on leaving."""
    if not applies(model):
        yield False
        return
    original = model.config._attn_implementation
    name = f"draftsmith-slots:{original}"
    AttentionInterface.register(name, _dispatching(original, attention_layout(model.config)))
    model.config._attn_implementation = name
    try:
        yield True
    finally:
        model.config._attn_implementation = original
