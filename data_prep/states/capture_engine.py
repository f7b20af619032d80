"""Hidden states from the serving engine: `data.capture.backend=vllm` (vLLM's offline `LLM` in this
process) and `server` (running vLLM servers, `scripts/serve_vllm.py`).

The targets that need heads most do not fit one process; their owners serve them with tensor and
expert parallelism in vLLM, and both peers read hidden states from there. vLLM's
`extract_hidden_states` speculative method keeps the hidden states of chosen layers for every
token it runs, and a KV connector writes them per request into a shared folder: one safetensors
file (`hidden_states` [T, layers, H] in the engine's dtype, `token_ids` [T]) behind `<file>.lock`,
its path returned in the request's `kv_transfer_params["hidden_states_path"]`. Each sample goes
as its token ids with one new token asked for; the file is read under a shared lock (the writer
holds it exclusively until the write ends), checked against the ids sent, then deleted.

What differs from transformers' `output_hidden_states`, and is made equal here:
- Layer id L is the input of decoder layer L, which is transformers' `hidden_states[L]` (the
  project's layer convention) for every L below the layer count N. Id N is the last layer's
  output **without the final norm**, where transformers' `hidden_states[N]` is normed: the
  target's final norm is applied here (`TargetTail`), and a test fails without it (one peer's
  acceptance moved from 25% to 40% when it found this).
- The target's top-1 per token (`CaptureSpec.target_top`) is the argmax of the target's lm_head
  over the final state as stored, as the `hf` path computes it. Only the final norm and the
  lm_head load here (from the checkpoint's tensors of those names), never the decoder.
- Prefix caching would skip the shared prefix's forward (its states never written: a shorter
  file) and chunked prefill splits a prompt over steps: both are off in the engine's arguments
  (`engine_args`), and the ids check names the server when a file does not match.
Engine numerics are not transformers' (other kernels, fused residual adds): states agree within
float32 noise, tests/e2e/test_vllm_capture.py states the tolerance. The stock connector needs
CUDA; on a CPU, draftsmith's synchronous subclass (`data_prep.states.vllm_connector`) is loaded by
`kv_connector_module_path`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from conf.errors import UserError
from conf.schema import CaptureConfig, RootConfig
from data_prep.answers.regen_server import Dispatcher, Endpoint, RequestFailed, call, connect
from data_prep.states.capture import CaptureSpec, kept_fields, overflow_message, with_top
from data_prep.states.connector_names import ASK, STOCK_CONNECTOR, SYNC_CONNECTOR, SYNC_CONNECTOR_MODULE
from data_prep.target import Target, data_base, resolve_device
from data_prep.vllm_engine import check_vllm_backend, engine

ENDPOINTS = "data.capture.endpoints"


def check_capture_backend(cfg: CaptureConfig) -> None:
    """What the capture backend needs from the outside world, before anything loads."""
    if cfg.backend == "vllm":
        check_vllm_backend("data.capture.backend=vllm")
    folder = Path(cfg.dir).expanduser() if cfg.dir else None
    if folder is not None and folder.exists() and not folder.is_dir():
        raise UserError(f"data.capture.dir={cfg.dir!r}: not a folder")


def engine_layer_ids(spec: CaptureSpec) -> list[int]:
    """The layer ids the engine keeps for `spec`: its aux layers and final layer, each once, in
    the order the file holds them."""
    kept = [*spec.aux_layer_ids, *([] if spec.final_layer_id is None else [spec.final_layer_id])]
    return sorted(set(kept))


def engine_args(spec: CaptureSpec, storage: str, stock: bool) -> dict[str, Any]:
    """vLLM's engine arguments (offline `LLM(...)` keywords; `vllm serve` flags of the same names)
    that make it write `spec`'s layers into `storage`: the stock connector (`stock`, CUDA) or
    draftsmith's synchronous one (any device)."""
    transfer = {"kv_connector": STOCK_CONNECTOR if stock else SYNC_CONNECTOR, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": storage}}
    if not stock:
        transfer["kv_connector_module_path"] = SYNC_CONNECTOR_MODULE
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(spec)}},
        },
        "kv_transfer_config": transfer,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
    }


def read_states(path: str, ids: list[int], where: str) -> torch.Tensor:
    """The [T, layers, H] states of the file the engine wrote for `ids` (read once its writer
    releases the lock), deleted once read; one line naming `where` when the lock file is missing
    (the folder is not shared) or the file holds other ids. A lock without a file is a writer
    that died mid-write (a killed server): FileNotFoundError, a failed request to retry."""
    lock = f"{path}.lock"
    try:
        fh = open(lock)
    except FileNotFoundError:
        raise UserError(
            f"{where}: the engine wrote {path}, which is not readable here; data prep and the servers "
            "must share that folder (scripts/serve_vllm.py --capture-dir, data.capture.dir)"
        ) from None
    try:
        with fh:
            fcntl.flock(fh, fcntl.LOCK_SH)  # sleeps until the writer's exclusive lock is released
            data = load_file(path, device="cpu")
    finally:
        for leftover in (path, lock):
            Path(leftover).unlink(missing_ok=True)
    got = data["token_ids"].tolist()
    if got != list(ids):
        raise UserError(
            f"{where}: the engine's hidden states are for {len(got)} tokens, not the {len(ids)} sent "
            "(prefix caching or chunked prefill on? start the server with scripts/serve_vllm.py)"
        )
    return data["hidden_states"]


def load_parts(target: Target, pick: Callable[[torch.nn.Module], list[torch.nn.Module]]) -> torch.nn.Module:
    """The target's skeleton with only the modules `pick` chooses from it loaded (from the
    checkpoint's tensors of their names, on the CPU, in the target's dtype); every other weight
    stays on the meta device, taking no memory, and fails loudly if anything runs it. What a
    process that never runs the target's decoder needs of it: the serving engine computes the
    states, this process their final norm, top-1 ids and the head's embeddings."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            target.config, dtype=target.dtype, trust_remote_code=target.trust_remote_code
        )
    modules = pick(skeleton)
    names: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    # (module, its parameter's name, every name of that parameter in the checkpoint)
    wanted = [(m, local, names[id(p)]) for m in modules for local, p in m.named_parameters()]
    tensors = checkpoint_tensors(target, [every for _, _, every in wanted])
    for module in modules:
        if any(p.is_meta for p in module.parameters()):  # a module tied to one loaded already
            module.to_empty(device="cpu")
    for module, local, every in wanted:
        with torch.no_grad():
            module.get_parameter(local).copy_(tensors[every[0]])
    for module in modules:
        module.eval().requires_grad_(False)
    return skeleton


def final_norm(target: Target, skeleton: torch.nn.Module) -> torch.nn.Module:
    """The decoder's final norm (`model.norm`), or one line sending the user to the hf backend."""
    norm = getattr(skeleton.get_decoder(), "norm", None)
    if norm is None:
        raise UserError(f"target.name_or_path={target.name!r}: no final norm at model.norm; "
                        "use data.capture.backend=hf")
    return norm


@dataclass
class TargetTail:
    """The target's final norm and lm_head, loaded alone from its checkpoint: what turns the
    engine's last-layer output into transformers' `hidden_states[N]` and its top-1 id."""

    norm: torch.nn.Module
    lm_head: torch.nn.Module

    @classmethod
    def load(cls, target: Target, device: torch.device | None = None) -> TargetTail:
        """Loaded on `device` (default `tail_device`): on a GPU the full-vocabulary top-1 costs
        ~1 GFLOP a token at 8B, tens of seconds a served batch on the host's cores."""
        skeleton = load_parts(target, lambda s: [final_norm(target, s), s.get_output_embeddings()])
        tail = cls.of(target, skeleton)
        at = tail_device() if device is None else device
        tail.norm.to(at)
        tail.lm_head.to(at)
        return tail

    @classmethod
    def of(cls, target: Target, skeleton: torch.nn.Module) -> TargetTail:
        """The tail of a skeleton whose norm and lm_head `load_parts` loaded."""
        return cls(final_norm(target, skeleton), skeleton.get_output_embeddings())


def tail_device() -> torch.device:
    """Where data prep runs the target's tail: this rank's GPU (`cuda:LOCAL_RANK`) where it has
    one, else the CPU."""
    return resolve_device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def checkpoint_tensors(target: Target, wanted: list[list[str]]) -> dict[str, torch.Tensor]:
    """Each wanted parameter's tensor from the target's safetensors checkpoint, keyed by its first
    name; a parameter is found under any of its names (a tied lm_head under the embeddings')."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(target.path, "model.safetensors.index.json", revision=target.revision,
                        _raise_exceptions_for_missing_entries=False)
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    else:
        weight_map = None
    out = {}
    for names in wanted:
        file = "model.safetensors"
        if weight_map is not None:
            listed = next((n for n in names if n in weight_map), None)
            if listed is None:
                raise UserError(f"target.name_or_path={target.name!r}: the checkpoint has no {names[0]}")
            file = weight_map[listed]
        path = cached_file(target.path, file, revision=target.revision)
        with safe_open(path, framework="pt") as fh:
            keys = set(fh.keys())
            name = next((n for n in names if n in keys), None)
            if name is None:
                raise UserError(f"target.name_or_path={target.name!r}: {file} has no {names[0]}")
            out[names[0]] = fh.get_tensor(name)
    return out


def needs_tail(spec: CaptureSpec, num_hidden_layers: int) -> bool:
    """Whether turning engine states into `spec`'s fields takes the target's final norm and
    lm_head: where it keeps the last layer (normed here) or the target's top-1."""
    return spec.target_top or num_hidden_layers in engine_layer_ids(spec)


class EngineStates:
    """Engine files -> the fields `capture.forward_hidden` gives: aux layers concatenated, the
    final layer normed, the target's top-1 where kept."""

    def __init__(self, spec: CaptureSpec, num_hidden_layers: int, tail: TargetTail | None):
        self.spec, self.last, self.tail = spec, num_hidden_layers, tail
        self.position = {layer: k for k, layer in enumerate(engine_layer_ids(spec))}

    @classmethod
    def of(cls, target: Target, spec: CaptureSpec, parts: torch.nn.Module | None = None) -> EngineStates:
        """For `target`, its tail only where `spec` keeps the last layer or the top-1: from
        `parts` (a skeleton `load_parts` loaded its norm and lm_head into), else loaded here."""
        layers = target.config.num_hidden_layers
        if not needs_tail(spec, layers):
            return cls(spec, layers, None)
        return cls(spec, layers, TargetTail.load(target) if parts is None else TargetTail.of(target, parts))

    @torch.no_grad()
    def layer(self, states: torch.Tensor, layer: int) -> torch.Tensor:
        """transformers' `hidden_states[layer]` [T, H] from the engine's [T, layers, H]."""
        h = states[:, self.position[layer]]
        if layer == self.last:  # on the tail's device; `kept_fields` brings it back
            weight = self.tail.lm_head.weight
            h = self.tail.norm(h.to(weight.device, weight.dtype))
        return h.float()

    def fields(self, states: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """The sample `name`'s fields from its engine states: each kept layer computed once,
        checked finite (lowest layer first, as the hf path names the one that overflowed)."""
        spec = self.spec
        layers = {k: self.layer(states, k) for k in self.position}
        for layer, h in layers.items():
            bad = (~torch.isfinite(h).all(-1)).nonzero()
            if len(bad):
                raise UserError(overflow_message(layer, int(bad[0]), name))
        return with_top(kept_fields(layers, spec, states.device), spec, self.tail and self.tail.lm_head)


def capture_folder(cfg: RootConfig) -> str:
    """Where an in-process engine writes: `data.capture.dir`, else `.capture` in the data cache
    (every file is deleted once read; requests' ids, which name the files, carry a random part,
    so runs sharing the folder do not collide)."""
    path = Path(cfg.data.capture.dir).expanduser() if cfg.data.capture.dir else data_base(cfg) / ".capture"
    path.mkdir(parents=True, exist_ok=True)
    return str(path.resolve())


class VllmCapturer:
    """`data.capture.backend=vllm`: vLLM's offline engine in this process; the transformers target
    is never loaded."""

    def __init__(self, cfg: RootConfig, target: Target, spec: CaptureSpec):
        c = cfg.data.capture
        self.states = EngineStates.of(target, spec)
        args = engine_args(spec, capture_folder(cfg), stock=torch.cuda.is_available())
        self.llm = engine(target.path, target.dtype, max(2048, cfg.data.max_length + 1),
                          tensor_parallel_size=c.tensor_parallel_size,
                          pipeline_parallel_size=c.pipeline_parallel_size, **args)

    def raw(self, samples: list[list[int]]) -> list[torch.Tensor]:
        """Each sample's states as the engine wrote them, [T, layers, H]."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {ASK: True}})
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in samples], params, use_tqdm=False)
        states = []
        for out, ids in zip(outs, samples):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise UserError("data.capture.backend=vllm: vLLM returned no hidden-states file")
            states.append(read_states(path, ids, "data.capture.backend=vllm"))
        return states

    def __call__(self, samples: list[list[int]], names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        for states, name in zip(self.raw(samples), names):
            yield self.states.fields(states, name)


# What a capture that lost every server says it kept, and how to go on (data prep's).
PREP_RESUME = "the shards captured so far are kept, run the same command again to capture the rest"


class CaptureDispatcher(Dispatcher):
    """The regeneration dispatcher's scheduling (threads per endpoint, retries, dropping a dead
    endpoint), for capture requests: one new token, the states' file read back by the thread.
    `resume`: what the line that stops a run without servers says was kept and how to go on."""

    resume = PREP_RESUME

    def _ask(self, ep: Endpoint, i: int) -> torch.Tensor:
        with self._watched(ep) as heard:
            body = {"model": ep.model, **self.body(i)}
            out = call(f"{ep.url}/completions", body, self.key, self.cfg.silence_s)
            heard()
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path is None:
            raise UserError(
                f"{ENDPOINTS}: {ep.url} returned no hidden-states file: start it with "
                "scripts/serve_vllm.py (extract_hidden_states and the connector)"
            )
        try:
            return read_states(path, self.prompts[i], f"{ENDPOINTS}: {ep.url}")
        except OSError as err:
            raise RequestFailed(str(err)) from None

    def _stop(self, left: int) -> None:
        why = "; ".join(f"{ep.url}: {ep.last_error}" for ep in self.endpoints)
        raise UserError(f"{ENDPOINTS}: no server answers ({why}); {self.resume}")


class ServerCapturer:
    """`data.capture.backend=server`: running vLLM servers of the target (`scripts/serve_vllm.py`),
    reached as regeneration reaches them (`data.regenerate`'s in_flight, retries, silence_s and
    api_key_env; a server silent on every request for silence_s is dropped at once:
    `data_prep.answers.regen_server`), each checked to serve the target before a request. An endpoint
    dropped stays dropped; the line that stops a run once none is left names every one and what it said last,
    then `resume` (`CaptureDispatcher.resume`). `parts`: as `EngineStates.of` takes it."""

    def __init__(self, cfg: RootConfig, target: Target, spec: CaptureSpec,
                 parts: torch.nn.Module | None = None, resume: str = PREP_RESUME):
        # The request settings of data.regenerate, whichever backend regenerates (or none does).
        self.cfg = dataclasses.replace(cfg.data.regenerate, backend="server",
                                       endpoints=cfg.data.capture.endpoints)
        self.endpoints = connect(self.cfg, target.name, target.path, target.tokenizer, ENDPOINTS)
        self.states = EngineStates.of(target, spec, parts)
        self.resume = resume

    def __call__(self, samples: list[list[int]], names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
        got: dict[int, torch.Tensor] = {}
        body = lambda i: {"prompt": samples[i], "max_tokens": 1, "kv_transfer_params": {ASK: True}}  # noqa: E731
        # The dead ones too: their threads end at once, and a call with none left says why.
        dispatcher = CaptureDispatcher(self.endpoints, samples, body, self.cfg, set())
        dispatcher.resume = self.resume
        dispatcher.run(got.__setitem__)
        for i, name in enumerate(names):
            yield self.states.fields(got.pop(i), name)


def engine_capturer(cfg: RootConfig, target: Target, spec: CaptureSpec):
    """The configured engine backend (`vllm` or `server`) for `target`."""
    backend = VllmCapturer if cfg.data.capture.backend == "vllm" else ServerCapturer
    return backend(cfg, target, spec)
