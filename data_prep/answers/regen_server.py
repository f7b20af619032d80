"""Regeneration through running OpenAI-compatible servers (`data.regenerate.backend=server`).

Published heads train on hundreds of thousands of regenerated conversations, more than one
process answers in a day; users already run the target behind `vllm serve` (or SGLang) on their
GPUs and nodes. This backend sends them the prompts and collects the answers, so the rest of data
prep is unchanged:
- Prompts go as token ids rendered by our chat template (the one renderer of every backend) to
  `/v1/completions`, answers come back as token ids (`return_token_ids`), so nothing is
  re-tokenised; sampling settings, per-answer seeds and stop ids are the other backends'.
- Before any request each endpoint must list the target in `/v1/models` (by its name, folder or
  the folder's last component, as `vllm serve <path>` or `--served-model-name` list it) and, where
  the server has `/tokenize`, encode a probe text as the target's tokenizer does: a server of
  another model is refused in one line.
- Each endpoint has `in_flight` requests open at once (threads; the server batches them); a
  free thread takes the next prompt, so a faster server answers more. A failed request is retried
  after a backoff that doubles; `retries` failures in a row drop the endpoint and its prompts go
  to the others; with none left the run stops in one line. Answers reach the caller as they
  arrive, on the caller's thread, and the caller appends each to the regeneration cache, so a
  killed run or a dead server loses nothing that was answered and the next run asks only for
  the rest.
- Answers are streamed (`"stream": true`: one `data:` event per few tokens, each carrying its
  delta's `token_ids`, then `data: [DONE]`), so a server that stops answering is seen without
  waiting out `timeout_s`: a server shutting down or hung may stop generating yet hold its
  connections open (seen with a vLLM sent SIGTERM), and a blocking request waited there for
  `timeout_s` (600 s) on each of its retries. Each read
  waits at most `silence_s`; a request silent that long fails, and when no request of its
  endpoint has had a byte in that time either, the endpoint is dropped at once, with no retries
  (a server silent on every connection is not busy), and every prompt it held goes back to the
  others: the endpoint is gone in about one `silence_s`. One stalled request beside others that
  flow (a request queued or preempted in the server) is an ordinary failure, retried. Capture
  requests (`data_prep.states.capture_engine`) follow the same rule with their whole response as the one
  sign of life: vLLM names the states' file only in a response that is not streamed, and a
  capture is one prefill, so a healthy server answers each well within `silence_s`.
- The API key is read from the environment variable `api_key_env` names and goes only into the
  Authorization header: never into a message, the config, the cache or the model card.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPResponse
from pathlib import Path

from conf.errors import UserError, first_line
from conf.schema import RegenerateConfig

PROBE_TEXT = "Speculative decoding drafts tokens; the target verifies them. 123 + 456 = 579."
BACKOFF_S = 0.5  # the first retry's wait; each further failure in a row doubles it
# HTTP statuses a retry can cure: the server is busy or restarting. Any other 4xx is the request's
# fault (a prompt longer than the server's max_model_len, a refused key) and stops the run.
TRANSIENT = {408, 429}


class RequestFailed(Exception):
    """A request that may succeed if sent again (connection, timeout, 5xx, 408/429)."""


class Silent(RequestFailed):
    """No byte came within the socket's timeout (`silence_s` while streaming)."""


class EndpointSilent(RequestFailed):
    """Neither this request nor any other of its endpoint had a byte for `silence_s`: the server
    has stopped answering (shutting down, hung), so the endpoint is dropped without retries."""


@dataclass
class Endpoint:
    """One server: its base URL (.../v1), the model id it serves the target as, and its tally."""

    url: str
    model: str = ""
    answered: int = 0
    tokens: int = 0
    failures: int = 0  # in a row
    last_error: str = ""
    dead: bool = False
    heard: float = 0.0  # time.monotonic() of the last line any of its streams brought

    @property
    def root(self) -> str:
        """The server's own routes (`/tokenize`) sit beside /v1, not under it."""
        return self.url.rstrip("/").removesuffix("/v1")


def api_key(cfg: RegenerateConfig) -> str | None:
    """The key from the environment, or one line naming the variable (never its value)."""
    if cfg.api_key_env is None:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise UserError(f"data.regenerate.api_key_env={cfg.api_key_env!r}: no such environment variable")
    return key


@contextmanager
def opened(url: str, body: dict | None, key: str | None, timeout: float) -> Iterator[HTTPResponse]:
    """One request (GET without a body), its response open while the block reads it, each socket
    read waiting at most `timeout`. Raises `Silent` when a read waits that long, `RequestFailed`
    for another failure a retry may cure and UserError for what it cannot; no message carries the
    key or a prompt."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            yield response
    except urllib.error.HTTPError as err:
        if err.code >= 500 or err.code in TRANSIENT:
            raise RequestFailed(f"HTTP {err.code}") from None
        detail = err.read(300).decode("utf-8", "replace").replace("\n", " ")
        raise UserError(f"data.regenerate.endpoints: {url} answered HTTP {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:  # refused, reset, timeout, bad JSON
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):  # connecting, the headers or a read of the body
            raise Silent(f"silent for {timeout:g} s") from None
        raise RequestFailed(first_line(str(reason)) or type(err).__name__) from None


def call(url: str, body: dict | None, key: str | None, timeout: float) -> dict:
    """One JSON request and its JSON answer (`opened` says what it raises)."""
    with opened(url, body, key, timeout) as response:
        return json.load(response)


def events(response: HTTPResponse, deadline: float, heard: Callable[[], None]) -> Iterator[dict]:
    """The JSON of each server-sent `data:` event up to `data: [DONE]`, calling `heard` at each
    line that arrives (a sign of life, whatever it holds). Past `deadline` (`timeout_s` after the
    request was sent) or at an error event the request fails; a stream cut before `[DONE]` ends
    here, and the caller sees the answer is unfinished."""
    for raw in response:  # each read waits at most the socket's timeout (`silence_s`)
        heard()
        if time.monotonic() > deadline:
            raise RequestFailed("still answering at data.regenerate.timeout_s")
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # the blank line closing an event, or an SSE comment
        data = line.removeprefix(b"data:").strip()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:  # vLLM's error mid-stream: {"error": {"message": ...}}, then [DONE]
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise RequestFailed(f"error while answering: {first_line(str(message))}")
        yield event


def served_names(target_name: str, target_path: str) -> set[str]:
    """The model ids a server of this target may list: the name the user gave, the folder it
    resolved to, and each one's last path component."""
    names = {target_name, target_path, str(Path(target_path).expanduser().resolve())}
    return names | {Path(n).name for n in names if n}


def connect(cfg: RegenerateConfig, target_name: str, target_path: str, tokenizer,
            what: str = "data.regenerate.endpoints") -> list[Endpoint]:
    """Every endpoint, each checked to serve the target, or one line naming the first that does
    not (and `what`, the override that lists them); no prompt is sent before all are checked."""
    if not cfg.endpoints:
        raise UserError(f"{what}=[]: some answers or states are not cached yet; list the servers "
                        f"that give them ({what.rpartition('.')[0]}.backend=server)")
    key, names = api_key(cfg), served_names(target_name, target_path)
    expected = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    endpoints = []
    for url in cfg.endpoints:
        ep = Endpoint(url.rstrip("/"))
        try:
            models = call(f"{ep.url}/models", None, key, min(cfg.timeout_s, 30))["data"]
        except (RequestFailed, KeyError, TypeError) as err:
            raise UserError(f"{what}: {ep.url}/models did not answer ({err})") from None
        listed = [m.get("id", "") for m in models]
        ep.model = next((m["id"] for m in models if {m.get("id"), m.get("root")} & names), "")
        if not ep.model:
            raise UserError(
                f"{what}: {ep.url} serves {listed}, not the target {target_name!r} "
                f"(serve it as `vllm serve {target_path}` or with --served-model-name {target_name})"
            )
        try:
            ask = {"model": ep.model, "prompt": PROBE_TEXT, "add_special_tokens": False}
            probe = call(f"{ep.root}/tokenize", ask, key, min(cfg.timeout_s, 30))
        except (RequestFailed, UserError):
            probe = None  # a server without /tokenize (the OpenAI API has none): the name must do
        if probe is not None and probe.get("tokens") != expected:
            raise UserError(
                f"{what}: {ep.url} ({ep.model}) tokenizes text otherwise than the target "
                f"{target_name!r}: it serves another model"
            )
        endpoints.append(ep)
    return endpoints


class Dispatcher:
    """Hands prompts to the endpoints' threads and their answers back to the caller's thread.

    Every prompt is in one of three places: `todo`, `asking` (in flight, and on which endpoint)
    or `settled` (answered). A dropped endpoint's prompts go back to `todo` at once, while its
    threads may still be blocked on its sockets; should one of them answer after all, the first
    answer of a prompt is kept and any later one dropped, so the caller sees each prompt once."""

    def __init__(self, endpoints: list[Endpoint], prompts: list[list[int]], body: Callable[[int], dict],
                 cfg: RegenerateConfig, stop_ids: set[int]):
        self.endpoints, self.prompts, self.body, self.cfg = endpoints, prompts, body, cfg
        self.stop_ids, self.key = stop_ids, api_key(cfg)
        self.todo: deque[int] = deque(range(len(prompts)))
        self.asking: dict[int, Endpoint] = {}
        self.settled: set[int] = set()
        self.lock = threading.Condition()
        self.finished = False
        self.answers: queue.Queue[tuple[int, list[int] | UserError]] = queue.Queue()

    def _take(self, ep: Endpoint) -> int | None:
        """The next prompt; waits while others are in flight (a failed one comes back)."""
        with self.lock:
            while not (self.todo or self.finished or ep.dead):
                self.lock.wait(0.2)
            if ep.dead or self.finished:
                return None
            i = self.todo.popleft()
            self.asking[i] = ep
            return i

    @contextmanager
    def _watched(self, ep: Endpoint) -> Iterator[Callable[[], None]]:
        """One request of `ep`, its block given `heard` to call at each sign of life. A read that
        waited `silence_s` (`Silent`) becomes `EndpointSilent` when no other request of the
        endpoint had a sign of life since this one's last either."""
        since = time.monotonic()

        def heard() -> None:
            nonlocal since
            since = ep.heard = time.monotonic()

        try:
            yield heard
        except Silent:
            if ep.heard <= since:  # no byte from any of its requests since this one's last
                silent = f"silent for {self.cfg.silence_s:g} s (data.regenerate.silence_s)"
                raise EndpointSilent(silent) from None
            raise

    def _ask(self, ep: Endpoint, i: int) -> list[int]:
        """Prompt i's answer from `ep`, streamed, through the stop token (as the other backends
        return it)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        body = {"model": ep.model, **self.body(i), "stream": True}
        with self._watched(ep) as heard, opened(f"{ep.url}/completions", body, self.key,
                                                self.cfg.silence_s) as response:
            ids = self._tokens(ep, events(response, deadline, heard))
        end = next((k + 1 for k, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return ids[:end]

    @staticmethod
    def _tokens(ep: Endpoint, stream: Iterator[dict]) -> list[int]:
        """The answer's token ids, joined from each event's delta (`return_token_ids`), once an
        event has said it is finished (`finish_reason`)."""
        ids: list[int] = []
        finished = False
        for event in stream:
            for choice in event.get("choices") or []:  # none in a closing usage event
                if choice.get("token_ids") is None:
                    raise UserError(
                        f"data.regenerate.endpoints: {ep.url} returned no token ids (a server without "
                        "`return_token_ids`: vLLM >= 0.10.2 has it)"
                    )
                ids += [int(t) for t in choice["token_ids"]]
                finished = finished or choice.get("finish_reason") is not None
        if not finished:
            raise RequestFailed("the stream ended before the answer did")
        return ids

    def _drop(self, ep: Endpoint, why: str) -> None:
        """Under the lock: `ep` answers no more; every prompt it holds goes to the others now."""
        ep.dead, ep.last_error = True, why
        for i in [i for i, e in self.asking.items() if e is ep]:
            self._give_back(i, ep)

    def _give_back(self, i: int, ep: Endpoint) -> None:
        """Under the lock: prompt i, asked of `ep`, goes back to `todo` unless it was answered or
        already handed to another endpoint."""
        if self.asking.get(i) is ep:
            del self.asking[i]
            if i not in self.settled:
                self.todo.appendleft(i)
                self.lock.notify()

    def _failed(self, ep: Endpoint, i: int, err: RequestFailed) -> float:
        """Counts a failure of `ep`, drops it when that was one too many (or it went silent), and
        returns the backoff before its thread asks again (none once it is dropped)."""
        with self.lock:
            self._give_back(i, ep)
            if ep.dead:
                return 0.0  # a late failure of a request its endpoint's drop already gave back
            ep.failures += 1
            ep.last_error = str(err)
            if isinstance(err, EndpointSilent):
                self._drop(ep, str(err))
            elif ep.failures > self.cfg.retries:
                self._drop(ep, f"{err} (after {self.cfg.retries} retries)")
            return 0.0 if ep.dead else BACKOFF_S * 2 ** (ep.failures - 1)

    def _answered(self, ep: Endpoint, i: int, ids: list[int]) -> None:
        """Hands prompt i's first answer to the caller (a late duplicate is dropped)."""
        with self.lock:
            if i in self.settled:
                return
            self.settled.add(i)
            if self.asking.get(i) is ep:
                del self.asking[i]
            elif i in self.todo:  # given back when `ep` was dropped, and not asked again yet
                self.todo.remove(i)
            ep.failures, ep.answered, ep.tokens = 0, ep.answered + 1, ep.tokens + len(ids)
        self.answers.put((i, ids))

    def _serve(self, ep: Endpoint) -> None:
        """One of an endpoint's `in_flight` threads: take a prompt, ask, hand the answer back."""
        while (i := self._take(ep)) is not None:
            try:
                ids = self._ask(ep, i)
            except RequestFailed as err:
                time.sleep(self._failed(ep, i, err))
                continue
            except UserError as err:
                self.answers.put((i, err))  # the caller raises it
                return
            self._answered(ep, i, ids)

    def run(self, on_finish: Callable[[int, list[int]], None]) -> None:
        for ep in self.endpoints:
            for _ in range(self.cfg.in_flight):
                threading.Thread(target=self._serve, args=(ep,), daemon=True).start()
        try:
            self._collect(on_finish)
        finally:
            with self.lock:
                self.finished = True
                self.lock.notify_all()

    def _collect(self, on_finish: Callable[[int, list[int]], None]) -> None:
        left = len(self.prompts)
        while left:
            try:
                i, ids = self.answers.get(timeout=0.2)
            except queue.Empty:
                if all(ep.dead for ep in self.endpoints):
                    self._stop(left)
                continue
            if isinstance(ids, UserError):
                raise ids
            on_finish(i, ids)
            left -= 1

    def _stop(self, left: int) -> None:
        why = "; ".join(f"{ep.url}: {ep.last_error}" for ep in self.endpoints)
        done = len(self.prompts) - left
        raise UserError(
            f"data.regenerate.endpoints: no server answers ({why}); "
            f"{done} of {len(self.prompts)} answers of this round are cached, run again to ask for the rest"
        )


class ServerAnswerer:
    """`regenerate.Answerer` for `backend=server`: connects (and checks) once, then answers each
    round of prompts through every live endpoint."""

    def __init__(self, cfg: RegenerateConfig, target_name: str, target_path: str, tokenizer):
        self.cfg, self.started = cfg, time.perf_counter()
        self.endpoints = connect(cfg, target_name, target_path, tokenizer)

    def __call__(self, prompts: list[list[int]], eos: set[int], seeds: list[int],
                 on_finish: Callable[[int, list[int]], None]) -> None:
        c = self.cfg
        sampling = {"max_tokens": c.max_new_tokens, "temperature": c.temperature, "top_p": c.top_p, "n": 1,
                    "stop_token_ids": sorted(eos), "return_token_ids": True}

        def body(i: int) -> dict:
            return {"prompt": prompts[i], **sampling, **({"seed": seeds[i]} if c.temperature > 0 else {})}

        live = [ep for ep in self.endpoints if not ep.dead]
        Dispatcher(live, prompts, body, c, eos).run(on_finish)

    def postfix(self) -> dict[str, str]:
        """New tokens/s per endpoint since connecting, for the progress bar."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {f"ep{k}": f"{ep.tokens / elapsed:.0f}tok/s" + (" dead" if ep.dead else "")
                for k, ep in enumerate(self.endpoints)}

    def step_cost(self) -> None:
        """Servers' steps are not seen from here: the planner prices them at the probe's rate."""
        return None
