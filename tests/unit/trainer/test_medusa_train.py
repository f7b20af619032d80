"""Medusa-1 and Medusa-2 through the shared training loop (`trainer.loop.fit`) on a tiny real
target: losses fall, checkpoints resume, head folders reload with their target, and
self-distilled LoRA training leaves the target's greedy outputs (almost) unchanged."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conf.errors import UserError
from conf.kinds import MedusaConfig
from conf.schema import DistConfig, LoggingConfig, OptimConfig, RootConfig, TargetConfig, derive
from heads.medusa.model import TARGET_DIR, MedusaHead, load_joint_target
from tests.support.targets import TINY
from trainer.distributed import build_accelerator
from trainer.kinds.medusa import build_medusa_trainee, greedy_token_drift, trainable_target
from trainer.loop import FitReport, fit, validation_metrics

VOCAB, PROMPT, ANSWER = 1024, 8, 24


class Samples(torch.utils.data.Dataset):
    """The loop's dataset interface (items + `lengths`) over samples made in memory from a tiny
    target forward, in place of data_prep's CapturedDataset."""

    def __init__(self, samples: list[dict[str, torch.Tensor]]):
        self.samples = samples
        self.lengths = [len(s["input_ids"]) for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


CYCLE = torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(7))[:256] + 3
NEXT = torch.zeros(VOCAB, dtype=torch.long)
NEXT[CYCLE] = CYCLE.roll(-1)


def walks(seed: int, count: int, length: int) -> torch.Tensor:
    """Sentences of the test language: a walk along one fixed cycle of 256 token ids."""
    g = torch.Generator().manual_seed(seed)
    tokens = [CYCLE[torch.randint(0, len(CYCLE), (count,), generator=g)]]
    for _ in range(length - 1):
        tokens.append(NEXT[tokens[-1]])
    return torch.stack(tokens, dim=1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on 2 shared cores: a second OpenMP thread mostly waits (10x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(one_thread):
    """A tiny Llama (1k vocabulary: the full-vocabulary losses dominate CPU time) trained until
    it continues the walk language confidently, as a real target continues text: a random one
    has near-ties everywhere, so any change flips its greedy tokens and tells nothing."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, eos_token_id=0, **TINY)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(80):
        ids = walks(step, 16, 32)
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def prompts(seed: int, count: int) -> list[list[int]]:
    return walks(seed, count, PROMPT).tolist()


@torch.no_grad()
def self_generated(model, seed: int, count: int) -> Samples:
    """Prompt + the target's own greedy answer (the loss positions), as data_prep's regeneration
    makes them, with the final (post-norm) hidden state Medusa-1 reads."""
    ids = torch.tensor(prompts(seed, count))
    seqs = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER, min_new_tokens=ANSWER,
        do_sample=False, pad_token_id=0,
    )
    hidden = model(seqs, output_hidden_states=True).hidden_states[-1]
    mask = torch.zeros(seqs.shape, dtype=torch.bool)
    mask[:, PROMPT:] = True
    return Samples(
        [{"input_ids": s, "loss_mask": m, "final_hidden": h} for s, m, h in zip(seqs, mask, hidden)]
    )


@pytest.fixture(scope="module")
def data(target):
    return self_generated(target, 1000, 48), self_generated(target, 2000, 12)


def make_cfg(run_dir: Path, head: MedusaConfig, **optim) -> RootConfig:
    settings = dict(lr=3e-3, warmup_ratio=0.0, batch_tokens=256, max_batch_size=8, val_every=10)
    return RootConfig(
        target=TargetConfig(name_or_path="tiny-1k", device="cpu"),
        optim=OptimConfig(**(settings | optim)),
        logging=LoggingConfig(tensorboard=False, progress=False, log_every=1),
        head=head,
        run_dir=str(run_dir),
    )


def train(cfg: RootConfig, target, data) -> tuple[dict, FitReport, list[float]]:
    """(validation metrics of the fresh trainee, fit's result, the logged training losses)."""
    torch.manual_seed(0)
    acc = build_accelerator(DistConfig(), cfg.optim, cfg.run_dir)
    trainee = build_medusa_trainee(cfg, target, None)
    before = validation_metrics(acc, trainee, data[1], cfg)
    result = fit(cfg, acc, trainee, data[0], data[1], Path(cfg.run_dir))
    history = json.loads((Path(cfg.run_dir) / "history.json").read_text())
    return before, result, [h["loss"] for h in history if "loss" in h]


def falls(losses: list[float], factor: float) -> bool:
    return sum(losses[-5:]) < factor * sum(losses[:5])


def test_medusa1_learns_the_continuations(target, data, tmp_path):
    cfg = make_cfg(tmp_path, MedusaConfig(num_heads=3), max_steps=30, lr=2e-2)
    before, result, losses = train(cfg, target, data)
    assert falls(losses, 0.5), losses
    assert result.best_score > before["score"] + 0.5, (before, result.best_score)
    head = MedusaHead.from_pretrained(result.head_dir, target, "tiny-1k")
    assert head.num_heads == 3 and head.config["target_update"] is None


def test_medusa2_lora_self_distilled_keeps_greedy_outputs(target, data, tmp_path, capsys):
    head_cfg = MedusaConfig(num_heads=3, joint=True, lora_rank=8, head_warmup_steps=5)
    cfg = make_cfg(tmp_path, head_cfg, max_steps=30)
    before, result, losses = train(cfg, target, data)
    assert before["lm_loss"] < 1e-6  # the LM term is KL to the original target: 0 at the start
    assert falls(losses, 0.7), losses
    assert result.best_score > before["score"] + 0.3, (before, result.best_score)

    head_dir = result.head_dir
    assert (head_dir / TARGET_DIR / "adapter_model.safetensors").exists()
    MedusaHead.from_pretrained(head_dir, target, "tiny-1k")
    tuned = load_joint_target(head_dir, target)
    assert tuned is not target and not any(p.requires_grad for p in tuned.parameters())
    drift = greedy_token_drift(target, tuned, prompts(2000, 12), ANSWER)
    with capsys.disabled():
        print(f"\nMedusa-2 LoRA self-distilled: greedy tokens changed {100 * drift:.2f}%")
    assert drift < 0.05

    cfg = derive(cfg, {"resume": True, "optim.max_steps": 32})  # the peft-wrapped target resumes too
    _, resumed, _ = train(cfg, target, data)
    history = json.loads((tmp_path / "history.json").read_text())
    steps = [h["step"] for h in history if "loss" in h]
    assert steps == list(range(1, 33)) and resumed.steps == 32


def test_medusa2_full_finetune_folder_carries_the_tuned_target(target, data, tmp_path):
    cfg = make_cfg(tmp_path, MedusaConfig(num_heads=1, joint=True, self_distill=False), max_steps=2)
    torch.manual_seed(0)
    acc = build_accelerator(DistConfig(), cfg.optim, cfg.run_dir)
    trainee = build_medusa_trainee(cfg, target, None)
    result = fit(cfg, acc, trainee, data[0], data[1], tmp_path)
    trainee.save_pretrained(tmp_path / "last")  # the live weights, to compare with
    tuned = load_joint_target(tmp_path / "last", target)
    ids = data[1][0]["input_ids"][None]
    with torch.no_grad():
        expected = trainee.target.eval()(ids).logits
        assert not torch.allclose(target(ids).logits, expected)  # it did train
        torch.testing.assert_close(tuned(ids).logits, expected)
    assert (result.head_dir / TARGET_DIR / "config.json").exists()
    # A damaged byte in the tuned target's weights is refused, naming the file, before it loads.
    weights = tmp_path / "last" / TARGET_DIR / "model.safetensors"
    data_bytes = bytearray(weights.read_bytes())
    data_bytes[-1] ^= 1
    weights.write_bytes(bytes(data_bytes))
    with pytest.raises(UserError, match=f"{weights} does not match its checksum in "):
        load_joint_target(tmp_path / "last", target)


def test_heads_warmup_keeps_the_head_loss_off_the_target(target, data, tmp_path):
    """While warming up the target's gradient is the LM term's alone; afterwards the heads'
    loss adds to it."""
    batch = {k: torch.stack([data[0][i][k] for i in range(4)]) for k in ("input_ids", "loss_mask")}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])

    def target_grads(trainee) -> list[torch.Tensor]:
        trainee.zero_grad()
        trainee(batch)["loss"].backward()
        return [p.grad.clone() for p in trainee.target.parameters()]

    def trainee(**head):
        cfg = MedusaConfig(num_heads=2, joint=True, self_distill=False, **head)
        return build_medusa_trainee(make_cfg(tmp_path, cfg), target, None).train()

    lm_only = target_grads(trainee(joint_head_loss_scale=0.0))
    warming = trainee(head_warmup_steps=1)
    for a, b in zip(target_grads(warming), lm_only):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    after = target_grads(warming)  # second batch: warmup over
    assert any(not torch.allclose(a, b) for a, b in zip(after, lm_only))




def test_medusa2_trains_float32_master_weights_of_a_bf16_target(tiny_model, tmp_path):
    """A GPU target is bf16. What trains is float32, starting from the bf16 weights upcast, while
    the teacher stays bf16; so an AdamW step under bf16 autocast whose updates lie below bf16's
    resolution still changes the weights (bf16 weights and moments would round it away)."""
    target = copy.deepcopy(tiny_model).to(torch.bfloat16)
    cfg = make_cfg(tmp_path, MedusaConfig(num_heads=1, joint=True))
    trainee = build_medusa_trainee(cfg, target, None).train()
    weights = target.state_dict()
    trained = dict(trainee.target.named_parameters())
    assert {n: p.dtype for n, p in trained.items()} == {n: torch.float32 for n in trained}
    for name, param in trained.items():
        torch.testing.assert_close(param.detach(), weights[name].float(), rtol=0, atol=0)
    assert {p.dtype for p in trainee.teacher.parameters()} == {torch.bfloat16}

    ids = torch.randint(3, target.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    opt = torch.optim.AdamW(trainee.param_groups(lr=1e-6, weight_decay=0.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainee(batch)["loss"].backward()
    opt.step()
    name = "model.layers.0.self_attn.q_proj.weight"
    before, after = weights[name], trained[name].detach()
    large = before.float().abs() > 1e-2  # where a 1e-6 step is far below bf16's spacing
    assert large.sum() > 100
    assert (after[large] != before[large].float()).all()  # the update survives in float32
    assert torch.equal(after[large].bfloat16(), before[large])  # and would round away in bf16

    lora = build_medusa_trainee(derive(cfg, {"head.lora_rank": 4}), target, None)
    dtypes = {p.requires_grad: set() for p in lora.target.parameters()}
    for param in lora.target.parameters():
        dtypes[param.requires_grad].add(param.dtype)
    assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}  # adapters fp32, base as loaded


def test_gradient_checkpointing_keeps_the_full_target_gradients(target, data):
    """A GPU's trained target recomputes its layers in backward (`trainable_target(checkpointing=
    True)`, asked where the target is on CUDA): the same loss and gradients as keeping them."""
    ids = data[0][0]["input_ids"][None]

    def grads(checkpointing: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        student = trainable_target(target, 0, checkpointing).train()
        assert student.is_activation_checkpointing == checkpointing
        loss = student(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad for p in student.parameters()]

    (loss, kept), (recomputed_loss, recomputed) = grads(False), grads(True)
    torch.testing.assert_close(recomputed_loss, loss, rtol=0, atol=0)
    for a, b in zip(recomputed, kept):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
