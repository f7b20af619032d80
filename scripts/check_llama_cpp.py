"""Serve GGUF exports with llama.cpp's own server and compare them with ours; one JSON line each.

    python scripts/check_llama_cpp.py <gguf export dir> [...] [--target <alias or .gguf>]
        [--prompts N|FILE.jsonl] [--max-tokens M] [--k K] [--threads T] [--ngram]

llama.cpp is the engine people run on CPUs and laptops: `llama-server -m target.gguf -md
draft.gguf --spec-type draft-eagle3` (or draft-dflash, draft-dspark: the `gguf`, `dflash-gguf`
and `dspark-gguf` exports), the build of scripts/setup_llama_cpp.sh, in .llama-cpp/.
Our side first (`check_vllm.ours_all`, in this process): the evaluator's prompts (MT-Bench,
HumanEval, GSM8K with the chat template, as token ids), our greedy text and our decoder's
acceptance on each export's weights. Then llama-server runs the target's GGUF, one server at a
time on this machine: without a draft, with each export as its draft (`--spec-type
draft-<kind>`, drafting exactly `--k` tokens a step, a block drafter its block - 1:
`--spec-draft-n-max K --spec-draft-p-min 0`, so that its τ counts as ours and vLLM's do), and
with `--ngram` also with llama.cpp's n-gram drafting (`ngram-simple`: the baseline a user of
llama.cpp already has, no head needed). Each prompt is one /completion request at temperature
0, its token ids returned. Per export:

- `loaded`: the server started with the draft and answered (`error`: its last log line if not);
- `identical`: [prompts whose greedy token ids with the draft equal those without, prompts];
- `llama_tau`: 1 + accepted / drafts from llama.cpp's counters (`draft_n`, `draft_n_accepted`,
  drafts = draft_n / K), and `ours_tau`, our decoder's on the same prompts and weights;
- `tokens_per_s` without and with the draft (llama.cpp's own `predicted_per_second`, pooled
  over the prompts), `speedup` their ratio, and with `--ngram` `ngram_speedup` and
  `ngram_identical` (llama.cpp's own drafting against its own greedy text: where it too parts,
  the engine's batched verification is parting at near-ties, not the head).

The target is `--target` (an alias: smollm2-135m-instruct or qwen2.5-coder-0.5b-instruct, or a
.gguf file), as llama.cpp runs it (SmolLM2's Q4_1, Qwen's Q4_K_M); our side runs the same
weights dequantized to float32 by transformers, so the two greedy texts may part at a near-tie:
`identical` compares llama.cpp with itself, as the lossless claim is the engine's. Its repacked
Q4_K kernels (Qwen's Q4_K_M) compute a K+1-token verify otherwise than a one-token step, so
texts may part at near-ties; `LLAMA_ARG_REPACK=0` in the environment turns repacking off.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / ".llama-cpp" / "bin" / "llama-server"
START_TIMEOUT_S = 300


def target_gguf(target: str | None) -> tuple[str, Path]:
    """(the target as our side loads it, the GGUF llama.cpp runs): an alias's GGUF, or a .gguf
    file; one line for anything else (llama.cpp reads GGUF only)."""
    from data_prep.target import ALIASES, alias_gguf

    name = target or "smollm2-135m-instruct"
    if name in ALIASES:
        return name, alias_gguf(name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path), path
    sys.exit(f"error: --target {name}: expected an alias ({', '.join(ALIASES)}) or a .gguf file: "
             "llama.cpp runs GGUF targets")


def draft_file(export_dir: str) -> Path:
    """The one .gguf file of a GGUF export folder."""
    found = sorted(Path(export_dir).glob("*.gguf"))
    if len(found) != 1:
        sys.exit(f"error: {export_dir}: expected one .gguf file (an export.formats=gguf folder), "
                 f"found {len(found)}")
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server process on a free local port, its log in a temporary file; a `with`
    block stops it."""

    def __init__(self, binary: Path, target: Path, extra: list[str], threads: int, context: int):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1", *extra]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait(self) -> str | None:
        """None once the server answers /health, else why not (its last log line)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return self.last_line() or f"llama-server exited with {self.process.returncode}"
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return None
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        return f"llama-server did not answer within {START_TIMEOUT_S} s"

    def last_line(self) -> str:
        lines = [line.strip() for line in Path(self.log.name).read_text(errors="replace").splitlines()]
        errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
        return (errors or lines or [""])[-1][:400]

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        """One greedy completion of token ids: its new token ids and llama.cpp's timings."""
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        request = urllib.request.Request(self.url("/completion"), json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            out = json.loads(r.read())
        return {"tokens": out["tokens"], "timings": out["timings"]}

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.unlink(self.log.name)


def serve_all(a: argparse.Namespace, target: Path, prompts: list[list[int]], extra: list[str]) -> dict:
    """llama-server with `extra` over every prompt: {"error"} when it did not start or answer,
    else the token ids per prompt and the pooled counters."""
    context = max(map(len, prompts)) + a.max_tokens + 64
    with Server(a.llama_server, target, extra, a.threads, context) as server:
        if (why := server.wait()) is not None:
            return {"error": why}
        try:
            runs = [server.complete(ids, a.max_tokens) for ids in prompts]
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError) as err:
            return {"error": f"{type(err).__name__}: {err} ({server.last_line()})"}
    timings = [r["timings"] for r in runs]
    tokens = sum(t["predicted_n"] for t in timings)
    return {
        "tokens": [r["tokens"] for r in runs],
        "tokens_per_s": round(tokens / (sum(t["predicted_ms"] for t in timings) / 1000), 2),
        "draft_n": sum(t.get("draft_n", 0) for t in timings),
        "draft_n_accepted": sum(t.get("draft_n_accepted", 0) for t in timings),
    }


def report(export: dict, plain: dict, drafted: dict, k: int, ngram: dict | None) -> dict:
    """One export's JSON line (module docstring)."""
    line = {"export": export["export"], "kind": export["kind"], "ours_tau": round(
        export["mean_acceptance_length"], 4), "ours_lossless": export["lossless"]}
    if "error" in plain or "error" in drafted:
        return {**line, "loaded": False, "error": plain.get("error") or drafted["error"]}
    same = identical(plain, drafted)
    drafts = drafted["draft_n"] / k
    llama_tau = 1 + drafted["draft_n_accepted"] / drafts if drafts else 1.0
    ours = export["mean_acceptance_length"]
    line |= {
        "loaded": True,
        "identical": same,
        "llama_tau": round(llama_tau, 4),
        "within_10pct": abs(llama_tau - ours) <= 0.1 * ours,
        "tokens_per_s": plain["tokens_per_s"],
        "tokens_per_s_drafted": drafted["tokens_per_s"],
        "speedup": round(drafted["tokens_per_s"] / plain["tokens_per_s"], 3),
    }
    if ngram is not None and "error" not in ngram:
        line |= {"tokens_per_s_ngram": ngram["tokens_per_s"],
                 "ngram_speedup": round(ngram["tokens_per_s"] / plain["tokens_per_s"], 3),
                 "ngram_identical": identical(plain, ngram)}
    return line


def identical(plain: dict, drafted: dict) -> list[int]:
    """[prompts whose greedy token ids with drafting equal those without, prompts]."""
    return [sum(a == b for a, b in zip(plain["tokens"], drafted["tokens"])), len(plain["tokens"])]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from conf.errors import exit_on_user_error
    from scripts.check_vllm import ours_all, prompt_source

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("export_dirs", nargs="+", metavar="export_dir", help="export.formats=gguf folders")
    ap.add_argument("--target", default=None, help="an alias or a .gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--prompts", type=prompt_source, default=10,
                    help="the evaluator's prompts, spread over its tasks (a count), or a JSONL of your own "
                         "(eval.prompts' format)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt (greedy)")
    ap.add_argument("--k", type=int, default=3, help="tokens drafted per step")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    ap.add_argument("--ngram", action="store_true", help="also llama.cpp's ngram-simple drafting")
    ap.add_argument("--llama-server", type=Path, default=SERVER, help="the llama-server binary")
    a = ap.parse_args()
    if not a.llama_server.is_file():
        sys.exit(f"error: --llama-server {a.llama_server}: no such file (scripts/setup_llama_cpp.sh "
                 "builds it)")
    export_dirs = [str(Path(d).resolve()) for d in a.export_dirs]
    drafts = [draft_file(d) for d in export_dirs]
    name, gguf = target_gguf(a.target)
    ref = exit_on_user_error(ours_all)(export_dirs, name, a.prompts, a.max_tokens, a.k)
    prompts = ref["prompt_token_ids"]
    plain = serve_all(a, gguf, prompts, [])
    ngram = serve_all(a, gguf, prompts, ["--spec-type", "ngram-simple"]) if a.ngram else None
    for export, draft in zip(ref["exports"], drafts):
        k = export["num_speculative_tokens"]  # a block drafter's block - 1, as ours drafts it
        extra = ["-md", str(draft), "--spec-type", f"draft-{export['kind']}", "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
        print(json.dumps(report(export, plain, serve_all(a, gguf, prompts, extra), k, ngram)), flush=True)


if __name__ == "__main__":
    main()
