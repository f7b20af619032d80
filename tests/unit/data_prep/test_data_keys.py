"""Cache keys by inclusion (`data_prep.folders.keys`): scheduling-only settings change neither the data
folder nor the answer cache, so a second build with other ones regenerates and captures nothing;
a setting that changes contents names a new folder."""

from __future__ import annotations

import dataclasses
import json

from conf.kinds import Eagle3Config
from conf.schema import (
    TEMPLATE_FIELDS,
    CaptureConfig,
    DataConfig,
    LoggingConfig,
    RegenerateConfig,
    RootConfig,
    TargetConfig,
)
from data_prep.folders.keys import (
    ANSWER_FIELDS,
    CAPTURE_FIELDS,
    FOLDER_FIELDS,
    SOURCE_FIELDS,
    answer_key,
    folder_key,
    regen_cache_file,
)
from data_prep.prepare import capture_spec, prepare
from data_prep.target import resolve_target
from heads.kinds import head_kind

WORDS = "apple river stone cloud garden rocket violin tiger".split()


def root(target_dir, source, cache_dir, batch_size: int, workers: int, **data) -> RootConfig:
    regen = RegenerateConfig(max_new_tokens=6, batch_size=batch_size, workers=workers)
    return RootConfig(
        target=TargetConfig(name_or_path=str(target_dir), num_threads=1),
        data=DataConfig(source=str(source), cache_dir=str(cache_dir), regenerate=regen,
                        **({"max_samples": 8, "shard_samples": 4, "draft_vocab_size": 300} | data)),
        logging=LoggingConfig(progress=False),
        head=Eagle3Config(),
    )


def test_scheduling_settings_reuse_the_folder_and_the_answers(tiny_llama_dir, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in WORDS))
    cache = tmp_path / "cache"
    first = prepare(root(tiny_llama_dir, src, cache, batch_size=2, workers=1))
    assert first.stats.regenerated_tokens > 0 and first.capture_tokens_per_s is not None
    answers = next((cache / "regenerated").glob("*.jsonl"))
    written = answers.read_bytes()
    manifest_time = (first.path / "manifest.json").stat().st_mtime_ns
    capsys.readouterr()

    other = root(tiny_llama_dir, src, cache, batch_size=8, workers=2)
    again = prepare(other)  # nothing regenerated, nothing captured: the folder is reused
    assert again.path == first.path and "reused" in capsys.readouterr().out
    assert (first.path / "manifest.json").stat().st_mtime_ns == manifest_time
    target = resolve_target(other)
    assert regen_cache_file(other, target.identity, target.chat_template) == answers
    assert answers.read_bytes() == written

    # Fewer samples: another folder, its answers all from the same cache.
    fewer = prepare(root(tiny_llama_dir, src, cache, batch_size=4, workers=1, max_samples=6))
    assert fewer.path != first.path
    assert fewer.stats.regenerated_tokens == 0 and fewer.stats.regenerated_from_cache == 6
    assert answers.read_bytes() == written


def test_keys_name_what_changes_contents_and_nothing_else(tiny_llama_dir, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    base = root(tiny_llama_dir, src, tmp_path / "a", batch_size=2, workers=1)
    target = resolve_target(base)
    identity, tpl = target.identity, target.chat_template

    def keys(cfg: RootConfig) -> tuple[dict, dict]:
        spec = capture_spec(cfg, head_kind(cfg.head.name), 8)
        return folder_key(cfg, identity, tpl, spec, 300), answer_key(cfg, identity, tpl)

    def data(cfg: RootConfig, **changes) -> RootConfig:
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **changes))

    def regen(cfg: RootConfig, **changes) -> RootConfig:
        return data(cfg, regenerate=dataclasses.replace(cfg.data.regenerate, **changes))

    folder, answers = keys(base)
    scheduling = [regen(base, batch_size=64, workers=3), data(base, cache_dir=str(tmp_path / "b")),
                  data(base, hidden_states="online")]  # the mode is named beside the key
    for cfg in scheduling:
        assert keys(cfg) == (folder, answers)
    for cfg in (data(base, max_length=256), regen(base, max_new_tokens=7), regen(base, temperature=0.5)):
        new_folder, new_answers = keys(cfg)
        assert new_folder != folder and new_answers != answers
    for cfg in (data(base, max_samples=9), data(base, seed=1), data(base, shard_samples=5),
                regen(base, enabled=False)):
        new_folder, new_answers = keys(cfg)
        assert new_folder != folder and new_answers == answers  # growing the set reuses answers
    # States from vLLM's kernels are not transformers' bit for bit, so the capture backend is
    # keyed; where the engine runs (endpoints, the shared folder, its parallelism) is not.
    def capture(cfg: RootConfig, **changes) -> RootConfig:
        return data(cfg, capture=dataclasses.replace(cfg.data.capture, **changes))

    served = capture(base, backend="server", endpoints=["http://127.0.0.1:8000/v1"])
    assert keys(served)[0] != folder and keys(served)[1] == answers
    assert keys(capture(served, endpoints=["http://10.0.0.2:9000/v1"], dir=str(tmp_path))) == keys(served)
    assert keys(capture(base, backend="vllm", tensor_parallel_size=8)) == keys(capture(base, backend="vllm"))


def test_every_data_setting_is_keyed_or_named_scheduling():
    """A new data setting fails here until it joins a key or the list of those that do not change
    contents (each justified in `data_prep.folders.keys`)."""
    not_keyed = {"cache_dir", "hidden_states", "matmul_dtype", "draft_vocab_size", "regenerate", "capture",
                 *TEMPLATE_FIELDS}  # keyed as what they resolve to, or field by field
    data = {f.name for f in dataclasses.fields(DataConfig)}
    assert data == {*SOURCE_FIELDS, *FOLDER_FIELDS, *not_keyed}
    regen = {f.name for f in dataclasses.fields(RegenerateConfig)}
    transport = {"endpoints", "in_flight", "retries", "timeout_s", "silence_s", "api_key_env"}
    assert regen == {*ANSWER_FIELDS, "enabled", "batch_size", "workers", *transport}
    capture = {f.name for f in dataclasses.fields(CaptureConfig)}
    assert capture == {*CAPTURE_FIELDS, "endpoints", "dir", "tensor_parallel_size", "pipeline_parallel_size",
                       "prefetch_batches"}

