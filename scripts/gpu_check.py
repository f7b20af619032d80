"""The GPU check: what one lent GPU must tell us about draftsmith, in about 5 minutes, one JSON
line per check, in this order (each says its seconds; a check that fails prints its error and the
next runs):

    env       the device, torch, transformers, and the copy bandwidth the memory bound uses
    sync      a training step never waits on the device (`torch.cuda.set_sync_debug_mode("error")`
              over EAGLE-3 steps at SpecForge's shapes)
    loss      the soft-target cross-entropy at SpecForge's shapes: the CPU's chunked path against
              the device's (ms forward + backward, peak memory), and that both agree
    attention which SDPA kernels the head's first step takes, on the path a CPU runs and on the
              device's own (`heads.eagle3.model.FUSED_KERNELS`), and the step time of each
    train     useful training tokens/s at SpecForge's `bench_train` shapes (4 x 1024 tokens, draft
              vocabulary 32k, TTT 7; padded and packed) beside SpecForge's own 53.4k on one H200
    capture   offline capture tokens/s (hidden states written to disk) beside the target's bare
              forward on the same batches
    decode    the evaluator's decoders: CUDA graphs captured (and steps run eagerly), greedy
              speculative output equal to plain greedy in bf16 and float32, ms per greedy token
              beside the memory-bound limit (weight bytes / measured copy bandwidth)
    zero      (only if time remains and DeepSpeed imports) ZeRO-2 and ZeRO-3 steps on one process

Nothing is downloaded: the target is random, of Llama-3.1-8B's shape on a GPU (a tiny Llama with
`--cpu`), and so are the batches; the shapes, not the weights, decide every figure here. `--cpu`
runs the very same checks at toy sizes, which CI does so that the script cannot rot before the
next GPU is lent (`tests/unit/scripts/test_gpu_check.py`); `scripts/gpu_check.sh` is how it runs
on the lent machine (wheels, time limit, the files that come back).

    python scripts/gpu_check.py [--cpu] [--out DIR] [--deadline SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from bench_train import (
    PRESETS,
    make_step,
    preset_batches,
    preset_trainee,
    timed_steps,
)
from transformers import LlamaConfig, LlamaForCausalLM

from conf.compose import compose_root
from conf.kinds import Eagle3Config
from data_prep.folders.store import capture_shards, open_partial
from data_prep.prepare import capture_spec
from data_prep.states.capture import bare_forward, exactly_causal
from data_prep.template import Tokenized
from heads.eagle3 import model as eagle3_model
from heads.eagle3.model import Eagle3Head
from heads.kinds import head_kind
from trainer.decoding import Chain, greedy_generate, speculative_generate
from trainer.decoding import graphs as decode_graphs
from trainer.distributed import build_accelerator, fast_float32_matmuls, prepare
from trainer.evaluate.run import load_drafter
from trainer.health import NonFiniteWatch
from trainer.kinds.eagle3 import attention_kernels
from trainer.loop import adamw, train_step
from trainer.objective import rows_per_block, soft_cross_entropy
from trainer.tally import Tally

SPECFORGE_USEFUL_TOKENS_PER_S = 53_419  # docs/benchmarks/eagle3-sequence-packing.md, H200, packed
LLAMA_3_1_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
TINY_LLAMA = LLAMA_3_1_8B | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=2048)


class Sizes:
    """What each check runs at: SpecForge's and Llama-3.1-8B's shapes on a GPU, toys with --cpu."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.preset = PRESETS["specforge", cpu]
        self.target = TINY_LLAMA if cpu else LLAMA_3_1_8B
        self.steps = (1, 2) if cpu else (3, 10)  # warm-up, timed
        self.capture_rows, self.capture_len = (8, 64) if cpu else (64, 1024)
        self.decode_prompt, self.decode_tokens = (16, 12) if cpu else (512, 64)
        self.draft_vocab = 256 if cpu else 32000


def device_of(cpu: bool) -> torch.device:
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (run with --cpu for the CPU rehearsal)")
    return torch.device("cuda")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Best of `reps` synchronised calls after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def peak_mib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def copy_gb_per_s(device: torch.device) -> float:
    """Bytes read plus written per second by a device-to-device copy of 1 GiB (64 MiB on a CPU):
    what a decode step that reads every weight once can at best stream."""
    n = (64 if device.type == "cpu" else 1024) * 2**20
    src, dst = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))
    return round(2 * n / timed(lambda: dst.copy_(src), device, reps=5) / 1e9, 1)


def eagle3_config(sizes: Sizes, extra: tuple[str, ...] = ()):
    head = [f"head.{k}={v}" for k, v in sizes.preset.head.items()]
    return compose_root(["+head=eagle3", *head, f"data.draft_vocab_size={sizes.preset.draft_vocab}", *extra])


def specforge_step(sizes: Sizes, device: torch.device, padding: str):
    """(step, batches, trainee): bench_train's preset=specforge step (its own loop, as
    SpecForge's benchmark times one) and its micro-batches of 4 equal documents."""
    cfg = eagle3_config(sizes)
    trainee = preset_trainee(cfg, sizes.preset, device)
    step, _ = make_step(trainee, cfg.optim, device, bf16=device.type == "cuda")
    warmup, steps = sizes.steps
    batches = preset_batches(sizes.preset, "equal", padding, warmup + steps, 0.75, trainee, device)
    return step, batches, trainee


def check_env(sizes: Sizes, device: torch.device) -> dict:
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "tf32_matmuls": torch.backends.cuda.matmul.allow_tf32,
        "copy_gb_per_s": copy_gb_per_s(device),
    }


@contextlib.contextmanager
def prepared(cfg, sizes: Sizes, device: torch.device, tmp: str):
    """(step, batches): `trainer.loop.train_step` as `fit` runs it (the accelerator of `cfg.dist`,
    its mixed precision, the non-finite watch and the tally) on bench_train's preset=specforge
    trainee and micro-batches. accelerate's state is a process singleton: reset on the way out,
    so that the next check may build another strategy."""
    from accelerate.state import AcceleratorState, PartialState

    acc = build_accelerator(cfg.dist, cfg.optim, tmp)
    try:
        trainee = preset_trainee(cfg, sizes.preset, acc.device)
        opt = adamw(trainee.param_groups(cfg.optim.lr, cfg.optim.weight_decay), cfg.optim)
        warmup, steps = sizes.steps
        batches = preset_batches(sizes.preset, "equal", "padded", warmup + steps, 0.75, trainee, acc.device)
        trainee, opt = prepare(acc, cfg.dist, trainee, opt)
        params = [p for g in opt.param_groups for p in g["params"]]
        watch, tally = NonFiniteWatch(acc.device, 0, check_grad_norm=True), Tally()
        def step(batch: dict) -> None:
            train_step(acc, trainee, opt, params, cfg.optim.grad_clip, batch, None, watch, tally)

        yield step, batches
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()


def check_sync(sizes: Sizes, device: torch.device) -> dict:
    """`train_step` after a warm-up, every sync an error on CUDA (on a CPU there is nothing to
    wait for: `tests/unit/trainer/test_sync_free.py` counts the ops that would sync there)."""
    cuda = device.type == "cuda"
    cfg = eagle3_config(sizes)
    with tempfile.TemporaryDirectory() as tmp, prepared(cfg, sizes, device, tmp) as (step, batches):
        step(batches[0])
        sync(device)
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for b in batches[1:]:
                step(b)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        sync(device)
    return {"steps": len(batches) - 1, "sync_free": True,
            "checked_by": "cuda sync debug mode" if cuda else "nothing on a CPU (the unit test counts syncs)"}


def check_loss(sizes: Sizes, device: torch.device) -> dict:
    """SpecForge's labelled rows (4 x 1024 tokens, 3/4 labelled) over its 32k draft vocabulary:
    the CPU's 1 MiB chunks, eager, against the device's own blocks (compiled on CUDA)."""
    rows = 4 * sizes.preset.row_len * 3 // 4
    vocab = sizes.preset.draft_vocab
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = torch.randn(rows, vocab, device=device, generator=g).to(dtype).requires_grad_()
    p = torch.softmax(torch.randn(rows, vocab, device=device, generator=g), -1)
    out = {"rows": rows, "vocab": vocab, "logits_dtype": str(dtype).removeprefix("torch.")}
    values = {}
    paths = {"cpu": {"rows": rows_per_block("cpu", vocab), "compiled": False},
             # --cpu: the device's whole blocks and its compiled body, on the CPU
             "device": {"rows": rows_per_block("cuda", vocab), "compiled": True} if sizes.cpu else {}}
    for path, how in paths.items():
        def run(how=how):
            logits.grad = None
            ce, _ = soft_cross_entropy(logits, p, **how)
            ce.sum().backward()
            return ce
        reset_peak(device)
        out[f"{path}_ms"] = round(1000 * timed(run, device), 2)
        out[f"{path}_peak_mib"] = peak_mib(device)
        values[path] = (run().detach().float(), logits.grad.float().clone())
    out["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(values["cpu"], values["device"]))
    return out


def check_attention(sizes: Sizes, device: torch.device) -> dict:
    """Which SDPA kernels the head's first step takes (`attention_kernels`: "math" alone is the
    [B, H, T, T] fallback), on the path a CPU runs (`FUSED_KERNELS=False`, what a GPU ran before)
    and on the device's own (forced with --cpu, so that CI runs the GPU's path), with the
    preset=specforge step time of each."""
    out = {}
    for path, fused in (("cpu_path", False), ("device_path", True if sizes.cpu else None)):
        eagle3_model.FUSED_KERNELS = fused
        try:
            reset_peak(device)
            step, batches, trainee = specforge_step(sizes, device, "padded")
            out[path] = attention_kernels(trainee.head, 4, sizes.preset.row_len)
            warmup, steps = sizes.steps
            seconds, _ = timed_steps(lambda i, b=batches, s=step: s(b[i]), device, warmup, steps)
            out[path] |= {"step_ms": round(1000 * sum(seconds) / steps, 2), "peak_mib": peak_mib(device)}
        finally:
            eagle3_model.FUSED_KERNELS = None
    return out


def check_train(sizes: Sizes, device: torch.device) -> dict:
    out = {"specforge_h200_useful_tokens_per_s": SPECFORGE_USEFUL_TOKENS_PER_S}
    for padding in ("padded", "packed"):
        reset_peak(device)
        step, batches, _ = specforge_step(sizes, device, padding)
        warmup, steps = sizes.steps
        seconds, _ = timed_steps(lambda i, b=batches, s=step: s(b[i]), device, warmup, steps)
        useful = sum(int(b["attention_mask"].sum()) for b in batches[warmup:])
        out[padding] = {"useful_tokens_per_s": round(useful / sum(seconds), 1),
                        "step_ms": round(1000 * sum(seconds) / steps, 2), "peak_mib": peak_mib(device)}
    out["ratio_to_specforge"] = round(out["packed"]["useful_tokens_per_s"] / SPECFORGE_USEFUL_TOKENS_PER_S, 3)
    return out


def random_target(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A random target built on the device itself (an 8B model's host copy would take minutes)."""
    config = LlamaConfig(**sizes.target, torch_dtype=dtype)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def check_capture(sizes: Sizes, device: torch.device) -> dict:
    """EAGLE-3's capture (three aux layers, the final one, the target's top-1) to a folder, as
    `data_prep.prepare` writes one (`capture_shards`: layer hooks, the encode on the device, the
    writer thread), beside the bare forward of the same batches; `exactly_causal`: the target runs
    without a mask (flash on CUDA)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_target(sizes, device, dtype)
    cfg = compose_root(["+head=eagle3"])
    spec = capture_spec(cfg, head_kind("eagle3"), model.config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    n, length, vocab = sizes.capture_rows, sizes.capture_len, sizes.target["vocab_size"]
    items = [Tokenized(torch.randint(vocab, (length - i % 7,), generator=g).tolist(),
                       [False] * (length // 4) + [True] * (length - i % 7 - length // 4), False, f"r{i}")
             for i in range(n)]
    batch_tokens = cfg.data.capture_batch_tokens if device.type == "cpu" else 16384
    shards = [items[i : i + cfg.data.shard_samples] for i in range(0, n, cfg.data.shard_samples)]
    tokens = sum(len(t.input_ids) for t in items)

    def to_disk() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            capture_shards(model, spec, shards, open_partial(Path(tmp) / "data", {}), batch_tokens)

    with torch.no_grad():
        forward_s = timed(lambda: bare_forward(model, shards, batch_tokens, False), device, reps=2)
        capture_s = timed(to_disk, device, reps=2)
    shape = f"{sizes.target['num_hidden_layers']} layers, hidden {sizes.target['hidden_size']}"
    return {"tokens": tokens, "batch_tokens": batch_tokens, "target": shape,
            "exactly_causal": exactly_causal(model.config, packed=False),
            "capture_tokens_per_s": round(tokens / capture_s, 1),
            "forward_tokens_per_s": round(tokens / forward_s, 1), "ratio": round(forward_s / capture_s, 3)}


@contextlib.contextmanager
def counting_graphs():
    """Counts CUDA graphs the decoders capture and those that failed (and so ran eagerly)."""
    counts = {"captured": 0, "failed": 0}
    capture = decode_graphs._capture

    def counted(*args):
        try:
            graph = capture(*args)
        except Exception:
            counts["failed"] += 1
            raise
        counts["captured"] += 1
        return graph

    decode_graphs._capture = counted
    try:
        yield counts
    finally:
        decode_graphs._capture = capture


def check_decode(sizes: Sizes, device: torch.device) -> dict:
    """The evaluator's greedy and speculative decoders on a random target with a fresh head (its
    acceptance means nothing; its output must still equal greedy's)."""
    out = {}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(sizes.target["vocab_size"], (sizes.decode_prompt,), generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        model = random_target(sizes, device, dtype)
        with tempfile.TemporaryDirectory() as tmp:
            v, d = sizes.target["vocab_size"], sizes.draft_vocab
            t2d = torch.zeros(v, dtype=torch.bool)
            t2d[:d] = True
            head = Eagle3Head.from_target(model, tmp, Eagle3Config(), torch.zeros(d, dtype=torch.long), t2d)
            path = head.save_pretrained(Path(tmp) / "head")
            del head
            drafter, verifier = load_drafter(path, model, tmp, [Chain(3)])
            with counting_graphs() as graphs, torch.no_grad():
                greedy_generate(verifier, prompt, 4)  # warm-up: the graphs are captured here
                plain = greedy_generate(verifier, prompt, sizes.decode_tokens)
                speculative_generate(verifier, drafter, prompt, 4, Chain(3))
                spec = speculative_generate(verifier, drafter, prompt, sizes.decode_tokens, Chain(3))
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bound_s = weight_bytes / (copy_gb_per_s(device) * 1e9)
        ms = 1000 * (plain.stats.total_s - plain.stats.prefill_s) / max(plain.stats.new_tokens - 1, 1)
        out[name] = {"lossless": plain.tokens == spec.tokens, "graphs": graphs,
                     "greedy_ms_per_token": round(ms, 3),
                     "memory_bound_ms_per_token": round(1000 * bound_s, 3),
                     "speculative_ms_per_token": round(1000 * spec.stats.total_s / spec.stats.new_tokens, 3)}
        del model, drafter, verifier
        reset_peak(device)
    return out


def check_zero(sizes: Sizes, device: torch.device) -> dict:
    """ZeRO-2 and ZeRO-3 `train_step`s at SpecForge's shapes, one process, under the autocast DDP
    steps take (`trainer.distributed.prepare`, which also refuses rotary frequencies DeepSpeed
    cast to 16 bits): step time and peak memory."""
    import deepspeed  # noqa: F401 (the check is skipped, as an error line, without it)

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29533"}.items():
        os.environ.setdefault(key, value)
    out = {}
    for stage in (2, 3):
        cfg = eagle3_config(sizes, (f"dist=zero{stage}",))
        with tempfile.TemporaryDirectory() as tmp, prepared(cfg, sizes, device, tmp) as (step, batches):
            warmup, steps = sizes.steps
            seconds, peak = timed_steps(lambda i, b=batches: step(b[i]), device, warmup, steps)
            out[f"zero{stage}"] = {"step_ms": round(1000 * sum(seconds) / steps, 2), "peak_mib": peak}
    return out


CHECKS: dict[str, Callable[[Sizes, torch.device], dict]] = {
    "env": check_env, "sync": check_sync, "loss": check_loss, "attention": check_attention,
    "train": check_train, "capture": check_capture, "decode": check_decode, "zero": check_zero,
}
LAST_ONLY_WITH = 90  # seconds the optional ZeRO check needs left


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the same checks on a CPU at toy sizes (CI)")
    ap.add_argument("--out", type=Path, help="also append the JSON lines to OUT/gpu_check.jsonl")
    ap.add_argument("--deadline", type=float, default=330.0,
                    help="seconds; checks not begun by then are skipped")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    sizes, device = Sizes(args.cpu), device_of(args.cpu)
    fast_float32_matmuls(device.type)  # as `trainer.train` starts
    sink = (args.out / "gpu_check.jsonl").open("a") if args.out else None
    failed = 0
    for name, check in CHECKS.items():
        left = args.deadline - (time.perf_counter() - started)
        if left <= 0 or (name == "zero" and left < LAST_ONLY_WITH and not args.cpu):
            record = {"check": name, "skipped": f"{left:.0f} s left"}
        else:
            t0 = time.perf_counter()
            try:
                record = {"check": name, **check(sizes, device)}
            except Exception as err:  # one check's failure is its own line, not the others'
                failed += 1
                record = {"check": name, "error": f"{type(err).__name__}: {err}"[:500]}
                traceback.print_exc(file=sys.stderr)
            record["seconds"] = round(time.perf_counter() - t0, 1)
        line = json.dumps(record)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
