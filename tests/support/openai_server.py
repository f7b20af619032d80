"""A small OpenAI-compatible completions server over a transformers model, for the fast tier.

It speaks the part of vLLM's API that `data_prep.answers.regen_server` uses (`/v1/models`, `/tokenize`,
`/v1/completions` with token-id prompts and `return_token_ids`, streamed as vLLM streams
them: a `data:` event per token carrying that delta's `token_ids`, the last with its
`finish_reason`, then `data: [DONE]`) and answers with draftsmith's own engine
(`regen_engine.generate`, one prompt per request), so the server backend's answers can be
compared with the `hf` backend's. It stands in for `vllm serve` only where a test needs failures
on cue (a server that errors, dies after n answers, goes silent, wants a key, serves another
name). Capture requests (whole, not streamed) it only holds silent, for the capture backend's
silence rule. tests/e2e/test_regen_server.py and test_capture_server.py run the real vLLM server.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from data_prep.answers.regen_engine import generate

# One engine run at a time in this process: servers of one test share one model, and the engine
# packs its linears and swaps its attention for a run (one process's `vllm serve` decodes one
# batch at a time too); two at once left the model on the slot attention of both.
ENGINE = threading.Lock()


@dataclass
class Behaviour:
    """What the server does besides answering."""

    model_id: str = "tiny"
    root: str = ""
    key: str | None = None  # the Bearer token it requires
    fail_first: int = 0  # completions answered HTTP 500 before the first success
    die_after: int | None = None  # stop serving after this many answers
    # After this many answers, a completion request gets its response headers and then nothing,
    # its connection held open until the server stops: a vLLM sent SIGTERM stops generating and
    # holds its connections so.
    silent_after: int | None = None
    token_offset: int = 0  # /tokenize returns ids shifted by this (another tokenizer)
    answered: list[list[int]] = field(default_factory=list)  # prompts answered, in order
    requests: int = 0  # completion requests received
    held: int = 0  # completion requests held silent


class Server:
    """`with Server(model, tok, behaviour) as s:` serves at `s.url` (.../v1) on 127.0.0.1."""

    def __init__(self, model, tokenizer, behaviour: Behaviour | None = None):
        self.model, self.tok, self.b = model, tokenizer, behaviour or Behaviour()
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # ends the silent requests' wait
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> Server:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _holds(self) -> bool:
        """Under the lock: counts a completion request, and whether it is to be held silent."""
        b = self.b
        b.requests += 1
        held = b.silent_after is not None and len(b.answered) >= b.silent_after
        b.held += held
        return held

    def _complete(self, body: dict) -> tuple[int, dict | None]:
        """The status and answer of a completion request; None: hold it silent."""
        b = self.b
        with self.lock:
            if self._holds():
                return 200, None
            if b.fail_first > 0:
                b.fail_first -= 1
                return 500, {"error": "busy"}
            if b.die_after is not None and len(b.answered) >= b.die_after:
                threading.Thread(target=self.stop, daemon=True).start()
                return 503, {"error": "shutting down"}
            seed = body.get("seed")
            with ENGINE:
                ids = generate(self.model, [body["prompt"]], max_new_tokens=body["max_tokens"], batch_size=1,
                               eos_token_ids=body["stop_token_ids"], temperature=body["temperature"],
                               top_p=body["top_p"], seeds=None if seed is None else [seed])[0]
            b.answered.append(body["prompt"])
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "stop"}]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, status: int, payload: dict | None) -> None:
                """As vLLM streams: an event per token, the last with the finish reason, then
                [DONE] (an error status goes whole, as vLLM refuses a request before streaming)."""
                if status != 200:
                    self._reply(status, payload)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.flush()
                if payload is None:
                    server.stopping.wait()
                    return
                ids = payload["choices"][0]["token_ids"]
                deltas = [ids[k:k + 1] for k in range(len(ids))] or [[]]
                for k, delta in enumerate(deltas):
                    end = "stop" if k == len(deltas) - 1 else None
                    choice = {"index": 0, "text": "", "token_ids": delta, "finish_reason": end}
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

            def _authorised(self) -> bool:
                key = server.b.key
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    self._reply(401, {"error": "bad key"})
                    return False
                return True

            def do_GET(self) -> None:
                if not self._authorised():
                    return
                if self.path == "/v1/models":
                    self._reply(200, {"data": [{"id": server.b.model_id, "root": server.b.root}]})
                else:
                    self._reply(404, {"error": "no route"})

            def do_POST(self) -> None:
                if not self._authorised():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = server.tok.encode(body["prompt"], add_special_tokens=False)
                    self._reply(200, {"tokens": [t + server.b.token_offset for t in ids]})
                elif self.path == "/v1/completions":
                    if body.get("stream") is True:
                        self._stream(*server._complete(body))
                        return
                    with server.lock:  # whole: a capture request; this server writes no states
                        held = server._holds()
                    if held:  # as vLLM holds a whole request: nothing sent, not even headers
                        server.stopping.wait()
                    else:
                        self._reply(400, {"error": "this server streams answers and keeps no states"})
                else:
                    self._reply(404, {"error": "no route"})

        return Handler
