"""Build a tiny random target WITH its multi-token-prediction layer, as DeepSeek-V3 and GLM-4.5 ship
them.

    python scripts/build_mtp_target.py --out <folder> --family deepseek_v3|glm4_moe [--pretrain-steps S]

transformers builds these families without their MTP layer (and drops it on load), so the folder is
made the way the vendors' checkpoints are: the model of N + 1 layers is built and saved by
transformers (its layer N in the checkpoint's own names, experts one by one), then layer N is
moved to a shard of its own beside the N-layer model, with the MTP tensors vLLM 0.32 loads
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the lm_head and embedding as
`shared_head.head` and `embed_tokens`); config.json says N layers and `num_nextn_predict_layers:
1`, and `model.safetensors.index.json` maps every tensor. The tokenizer is the one given
(`--tokenizer`: SmolLM2's by default; the tests' byte-level one keeps the vocabulary at 259).
Sizes are the tests' tiny ones: hidden 64, MoE layers of 4 experts (the MTP layer's among them, as
DeepSeek-V3's layer 61 is).

`--pretrain-steps S` then trains the shipped MTP layer briefly (one step ahead, on the target's own
greedy text from random prompts) so that it starts better than random, as a vendor's does, and
fine-tuning has something to improve on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conf.errors import exit_on_user_error
from heads.mtp.model import INDEX

MAIN, MTP = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False,
)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, n_group=1, topk_group=1)
# model_type -> its settings past TINY and MOE. DeepSeek-V3's attention is MLA (q and kv LoRA
# ranks, a rotary part of each head) and its router DeepSeek-V3's own (`noaux_tc`: the sigmoid
# scores and `e_score_correction_bias` vLLM loads); GLM-4.5's is GQA with a partial rotary embedding.
FAMILIES = {
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid"),
    "glm4_moe": dict(head_dim=16, partial_rotary_factor=0.5),
}


def tiny_config(family: str, vocab: int, layers: int, **overrides):
    """A tiny `family` config of `layers` layers that declares one MTP layer."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        family, vocab_size=vocab, num_hidden_layers=layers, num_nextn_predict_layers=1,
        **{**TINY, **MOE, **FAMILIES[family], **overrides},
    )


def tiny_mtp_model(family: str, vocab: int, layers: int = 2, seed: int = 0):
    """A tiny random `family` target in memory (no folder: its MTP layer has no shipped weights,
    so a head on it starts with `head.init=scratch`), float32, in eval mode without gradients."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab, layers), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def build_mtp_target(out: Path, family: str, tokenizer, layers: int = 2, seed: int = 0, **overrides) -> Path:
    """The folder described above, at `out` (`overrides`: config fields past the tiny sizes)."""
    from transformers import AutoModelForCausalLM

    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = tiny_config(family, len(tokenizer), layers + 1, **ids, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(Path(tmp) / "model.safetensors", "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    prefix = f"model.layers.{layers}."
    main = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    mtp = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    h, std = config.hidden_size, config.initializer_range
    g = torch.Generator().manual_seed(seed + 1)
    mtp.update({
        prefix + "enorm.weight": torch.ones(h),
        prefix + "hnorm.weight": torch.ones(h),
        prefix + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * std,
        prefix + "shared_head.norm.weight": torch.ones(h),
        prefix + "shared_head.head.weight": main["lm_head.weight"].clone(),
        prefix + "embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
    })
    out.mkdir(parents=True, exist_ok=True)
    save_file(main, out / MAIN, metadata={"format": "pt"})
    save_file(mtp, out / MTP, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
             "weight_map": {**dict.fromkeys(sorted(main), MAIN), **dict.fromkeys(sorted(mtp), MTP)}}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config.num_hidden_layers = layers
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def pretrain_mtp(folder: Path, steps: int, lr: float = 3e-3, seed: int = 0) -> None:
    """Train the folder's MTP layer `steps` steps, one step ahead (step 0 alone), on the target's
    greedy continuations of 8 random prompts (generated once), and write it back into its shard:
    a layer that predicts better than random, as a vendor's, short of what fine-tuning reaches."""
    from transformers import AutoModelForCausalLM

    from conf.kinds import MtpConfig
    from heads.mtp.model import MtpHead
    from trainer.kinds.mtp import MtpTrainee

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    head = MtpHead.from_target(model, str(folder), MtpConfig(num_steps=1))
    trainee = MtpTrainee(head, 1, 0.6)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (8, 8), generator=g)
    with torch.no_grad():
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=56,
                             do_sample=False, eos_token_id=[], pad_token_id=0)
        final = model(ids, output_hidden_states=True).hidden_states[-1]
    batch = {"input_ids": ids, "final_hidden": final, "loss_mask": torch.ones_like(ids, dtype=torch.bool),
             "attention_mask": torch.ones_like(ids)}
    for _ in range(steps):
        loss = trainee(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    shard = folder / MTP
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors.update({k: v.detach().contiguous() for k, v in head.checkpoint_tensors().items()})
    save_file(tensors, shard, metadata={"format": "pt"})


def tokenizer_of(name_or_path: str):
    """The tokenizer of a target (`target.name_or_path`'s values: a folder, a Hub id, an alias)."""
    from conf.schema import RootConfig, TargetConfig
    from data_prep.target import resolve_target

    return resolve_target(RootConfig(target=TargetConfig(name_or_path=name_or_path))).tokenizer


@exit_on_user_error
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES), help="the model_type")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers before the MTP layer")
    parser.add_argument("--pretrain-steps", type=int, default=0, help="steps of brief MTP pre-training")
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct",
                        help="the target whose tokenizer the folder gets (SmolLM2's by default)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    build_mtp_target(out, args.family, tokenizer_of(args.tokenizer), args.layers)
    if args.pretrain_steps:
        pretrain_mtp(out, args.pretrain_steps)
    print(json.dumps({"out": str(out), "family": args.family, "pretrain_steps": args.pretrain_steps}))


if __name__ == "__main__":
    main(sys.argv[1:])
