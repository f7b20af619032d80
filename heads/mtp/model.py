"""The target's own multi-token-prediction (MTP) layer as a draft head: read from the target's
safetensors (transformers drops it on load), trained recursively, written back.

A DeepSeek-V3 or GLM-4.5 checkpoint holds its MTP module as one more decoder layer after the
last, at `model.layers.{N}` (N = num_hidden_layers; `num_nextn_predict_layers` of them), with the
names vLLM 0.32 loads (`deepseek_mtp.py`, `glm4_moe_mtp.py`): `enorm` and `hnorm` (RMSNorms of
the next token's embedding and of the hidden state), `eh_proj` ([H, 2H] over the concatenation
[enorm(embedding) ; hnorm(hidden)], in that order), `shared_head.norm` (the final norm before the
logits), `shared_head.head` and `embed_tokens` (copies of the target's lm_head and embedding,
frozen and shared here), and the decoder block's own tensors in the family's names. The block is
the family's transformers decoder-layer class (the target's own attention and MoE maths); the
rest is plain PyTorch.

What vLLM feeds it (so what capture keeps and the decoder passes): step 0 reads the target's
output hidden state, after its final norm (vLLM's target models return `self.norm(...)`: HF
`hidden_states[N]`), and the embedding of the next token, zeroed at position 0; step k > 0 reads
the MTP layer's own output at the previous step, after `shared_head.norm` on DeepSeek-V3 (vLLM
0.32 recycles the normed state) and before it on GLM-4.5 (its MTP layer returns the pre-norm
state), which `Family.recycle_norm` records. The logits are the shared lm_head over
`shared_head.norm(output)` in both.

The head's own tensor names are its modules' (`block.*` in transformers' in-memory layout, whose
MoE experts are fused); `checkpoint_tensors` / `from_checkpoint` convert to and from the
checkpoint's names (experts one by one), the one place that knows them.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from conf.errors import UserError
from conf.kinds import MtpConfig
from heads.folder import TargetSpec, load_head, save_head

INDEX = "model.safetensors.index.json"
# How the MTP layer's MoE experts run (transformers' `experts_implementation`): grouped_mm routes
# tokens with device-side offsets, where "eager" loops over the experts hit, read back from the device.
EXPERTS = "grouped_mm"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class Family:
    """A target family whose checkpoints hold MTP layers that this kind trains."""

    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # its classes' prefix: <prefix>DecoderLayer, <prefix>RotaryEmbedding, <prefix>RMSNorm
    recycle_norm: bool  # step k > 0 reads the previous step's output after shared_head.norm (vLLM 0.32)

    def classes(self) -> tuple[type, type, type]:
        """(decoder layer, rotary embedding, RMSNorm) classes of the family, from transformers."""
        mod = importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")
        names = ("DecoderLayer", "RotaryEmbedding", "RMSNorm")
        return tuple(getattr(mod, f"{self.prefix}{n}") for n in names)


# model_type -> family. Both lay their MTP layers out as `model.layers.{N+i}.*` (vLLM 0.32).
FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3", recycle_norm=True),
    "glm4_moe": Family("glm4_moe", "Glm4Moe", recycle_norm=False),
}
# Families that ship MTP layers in other layouts, named in the refusal: Qwen3-Next / Qwen3.5
# (`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.layers.{i}`, `mtp.norm`) and MiMo
# (`model.mtp_layers.{i}`), which vLLM serves as method "mtp" too.
OTHER_MTP_FAMILIES = ("qwen3_next", "qwen3_5", "mimo")
# The MTP layer's own tensors besides its decoder block, in the checkpoint's names.
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
# Copies of the target's tables, kept in the checkpoint as they are (frozen, shared).
SHARED = ("embed_tokens.weight", "shared_head.head.weight")
# What a head folder's config holds (`MtpHead.head_config`).
CONFIG_KEYS = ("family", "layer_index", "recycle_norm", "num_steps", "target_config")
# The head's modules that are the target's (or derived from its config): never saved.
FROZEN = ("embed_tokens.", "lm_head.", "rotary.")
EXPERT = re.compile(r"^(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def mtp_layers(target_config) -> int:
    """How many MTP layers the target's config declares (0: none, or a family not trained here)."""
    t = target_config.get_text_config()
    if t.model_type not in FAMILIES:
        return 0
    return int(getattr(t, "num_nextn_predict_layers", 0) or 0)


def check_target(cfg: MtpConfig, target_config) -> None:
    """Refuse, in one line before any weights load, a target without MTP layers this kind reads
    (`HeadKind.check_target`), naming the families that have them."""
    t = target_config.get_text_config()
    if mtp_layers(target_config) < 1:
        raise UserError(
            f"+head=mtp: the target ({t.model_type}) has no multi-token-prediction layers to train; "
            f"targets with them: {', '.join(FAMILIES)} (trained here), {', '.join(OTHER_MTP_FAMILIES)} "
            "(not yet); choose another head kind for this target"
        )
    if (count := mtp_layers(target_config)) > 1:
        raise UserError(
            f"+head=mtp: the target declares {count} MTP layers (num_nextn_predict_layers); "
            "this kind trains one, as DeepSeek-V3 and GLM-4.5 ship (vLLM cycles several by draft step)"
        )
    folder = Path(getattr(target_config, "_name_or_path", "") or "")
    if cfg.init == "native" and (folder / "config.json").exists():
        prefix = layer_prefix(t.num_hidden_layers)
        if not any(name.startswith(prefix) for name in weight_map(folder)):
            raise UserError(
                f"+head=mtp: {folder} declares MTP layers but its safetensors hold nothing under "
                f"{prefix!r} (transformers drops them when it saves a model): point "
                "target.name_or_path at the vendor's checkpoint, or train from scratch with head.init=scratch"
            )


def captured_layers(cfg: MtpConfig, num_hidden_layers: int) -> tuple[tuple[int, ...], int]:
    """(aux layer ids, final layer id): the target's final hidden state (after its norm), what
    vLLM feeds the MTP layer and what the teacher's distribution comes from."""
    return (), num_hidden_layers


def family_config(config: dict):
    """The target's text config (a transformers config) from the head config's copy of it."""
    from transformers import AutoConfig

    t = dict(config["target_config"])
    model_type = t.pop("model_type")
    for key in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        t.pop(key, None)
    made = AutoConfig.for_model(model_type, **t)
    made._attn_implementation = "sdpa"
    made._experts_implementation = EXPERTS
    return made


def unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) -> the checkpoint's per-expert `experts.{e}.{gate,up,down}_proj.weight`."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            for e, both in enumerate(value):
                gate, up = both.chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e, down in enumerate(value):
                out[f"{base}.{e}.down_proj.weight"] = down
        else:
            out[name] = value
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`unfuse_experts` undone: per-expert checkpoint tensors -> transformers' fused ones."""
    out, experts = {}, {}
    for name, value in tensors.items():
        m = EXPERT.match(name)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = value
        else:
            out[name] = value
    for base, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate"], by_expert[e]["up"]], 0) for e in order]
        )
        out[f"{base}.down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> the file of the target folder that holds it (an index, or one file)."""
    if (folder / INDEX).exists():
        return json.loads((folder / INDEX).read_text())["weight_map"]
    if (folder / SINGLE).exists():
        with safe_open(folder / SINGLE, "pt") as f:
            return dict.fromkeys(f.keys(), SINGLE)
    raise UserError(
        f"target {folder}: neither {INDEX} nor {SINGLE} there; MTP weights are read from safetensors"
    )


def layer_prefix(layer_index: int) -> str:
    return f"model.layers.{layer_index}."


def read_checkpoint_layer(folder: Path, layer_index: int) -> dict[str, torch.Tensor]:
    """Every tensor of the target's MTP layer `layer_index`, in the checkpoint's names less the
    layer prefix (shared copies included), read a file at a time."""
    prefix, files = layer_prefix(layer_index), {}
    for name, file in weight_map(folder).items():
        if name.startswith(prefix):
            files.setdefault(file, []).append(name)
    out = {}
    for file, names in files.items():
        with safe_open(folder / file, "pt") as f:
            out.update({n.removeprefix(prefix): f.get_tensor(n) for n in names})
    return out


def to_checkpoint_names(tensors: dict[str, torch.Tensor], layer_index: int) -> dict[str, torch.Tensor]:
    """A head's trained tensors (its modules' names) -> the checkpoint's: `model.layers.{N}.`
    before each, the block's own prefix dropped, its experts one by one."""
    block = {k.removeprefix("block."): v for k, v in tensors.items() if k.startswith("block.")}
    rest = {k: v for k, v in tensors.items() if not k.startswith("block.")}
    return {layer_prefix(layer_index) + k: v for k, v in {**rest, **unfuse_experts(block)}.items()}


def from_checkpoint_names(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`read_checkpoint_layer`'s tensors -> the head's names (its trained tensors only: the
    shared copies of the target's tables are left out)."""
    mine = {k: v for k, v in layer.items() if k not in SHARED}
    block = fuse_experts({k: v for k, v in mine.items() if k not in OWN})
    return {**{k: mine[k] for k in OWN if k in mine}, **{f"block.{k}": v for k, v in block.items()}}


class SharedHead(nn.Module):
    """`shared_head`: the final norm before the logits (the lm_head is the target's, shared)."""

    def __init__(self, hidden: int, norm_class: type, eps: float):
        super().__init__()
        self.norm = norm_class(hidden, eps=eps)


class MtpHead(nn.Module):
    """One MTP layer. `embed_tokens` and `lm_head` are the target's, frozen and never saved."""

    kind = "mtp"

    def __init__(self, config: dict, target: TargetSpec):
        super().__init__()
        family = FAMILIES[config["family"]]
        layer_class, rotary_class, norm_class = family.classes()
        tc = family_config(config)
        self.text_config = tc
        h, v, eps = tc.hidden_size, tc.vocab_size, tc.rms_norm_eps
        # A transformers config, as the decoders read a head's (`config.vocab_size`, its window).
        self.config = PretrainedConfig(**{**config, "vocab_size": v})
        self.target = target
        self.layer_index, self.recycle_norm = config["layer_index"], config["recycle_norm"]
        self.aux_layer_ids = [tc.num_hidden_layers]  # what the decoder captures: the final state
        self.enorm = norm_class(h, eps=eps)
        self.hnorm = norm_class(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, norm_class, eps)
        self.block = layer_class(tc, self.layer_index)
        self.rotary = rotary_class(tc)
        self.embed_tokens = nn.Embedding(v, h).requires_grad_(False)
        self.lm_head = nn.Linear(h, v, bias=False).requires_grad_(False)
        self.vocab_size = v

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def head_config(target_config, cfg: MtpConfig) -> dict:
        t = target_config.get_text_config()
        return {
            "family": t.model_type,
            "layer_index": t.num_hidden_layers,  # the first MTP layer (vLLM's mtp_start_layer_idx)
            "recycle_norm": FAMILIES[t.model_type].recycle_norm,
            "num_steps": cfg.num_steps,
            "target_config": t.to_dict(),
        }

    @classmethod
    def from_target(cls, target_model, target_name: str, cfg: MtpConfig) -> MtpHead:
        """The target's MTP layer 0 as a head: its native weights from the target's folder, or a
        fresh init (`head.init=scratch`); the target's embedding and lm_head copied in, frozen."""
        check_target(cfg, target_model.config)
        spec = TargetSpec.from_model(target_model, target_name)
        head = cls(cls.head_config(target_model.config, cfg), spec)
        if head.eh_proj.weight.is_meta:  # a skeleton (the planner's probes): no weights to read
            return head
        if cfg.init == "native":
            folder = Path(getattr(target_model, "name_or_path", "") or target_name)
            head.load_checkpoint_layer(read_checkpoint_layer(folder, head.layer_index), str(folder))
        else:
            head.reset_parameters()
        head.share_target_tables(target_model)
        return head

    def reset_parameters(self) -> None:
        """A fresh MTP layer: norms at one, biases at zero, matrices ~ N(0, initializer_range)."""
        std = self.text_config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not p.requires_grad:
                    continue
                if p.dim() >= 2:
                    p.normal_(0.0, std)
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.zero_()

    def share_target_tables(self, target_model) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight.float())
            self.lm_head.weight.copy_(target_model.get_output_embeddings().weight.float())

    def trained_state(self, state: dict | None = None) -> dict[str, torch.Tensor]:
        """The tensors this head trains (and saves), in its modules' names."""
        return {k: v for k, v in (state or self.state_dict()).items() if not k.startswith(FROZEN)}

    def checkpoint_tensors(self, state: dict | None = None) -> dict[str, torch.Tensor]:
        """The trained tensors in the target checkpoint's names: what the stitched export writes."""
        return to_checkpoint_names(self.trained_state(state), self.layer_index)

    def load_checkpoint_layer(self, layer: dict[str, torch.Tensor], where: str) -> None:
        """Load the MTP layer as `read_checkpoint_layer` returns it; one line naming what is
        missing or left over."""
        if not layer:
            raise UserError(
                f"target {where}: no tensors under {layer_prefix(self.layer_index)!r} (its MTP layer); "
                "train from scratch with head.init=scratch"
            )
        state = from_checkpoint_names(layer)
        missing, unexpected = self.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        missing = [k for k in missing if not k.startswith(FROZEN)]
        if missing or unexpected:
            raise UserError(
                f"target {where}: MTP layer {self.layer_index}: missing {missing}, unexpected {unexpected}"
            )

    # ---- compute ------------------------------------------------------------------------
    @property
    def fc(self) -> nn.Linear:
        """The input projection, where the decoder reads the head's dtype and device."""
        return self.eh_proj

    def layer(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        past=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step over T positions -> (the hidden the next step reads, the pre-norm output).

        hidden [B,T,H]: the target's final (normed) state or the previous step's recycled one;
        input_ids [B,T]: the token after each position, embedded with the target's table and
        zeroed at position 0 (vLLM's rule); mask: None (causal, no past) or one the block's
        attention takes ([B|1,1,T,P+T]); past: a cache the block writes its K/V into."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        embeds = torch.where(position_ids[..., None] == 0, 0, embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out = self.block(
            x, attention_mask=mask, position_ids=position_ids, cache=past,
            position_embeddings=self.rotary(x, position_ids),
        )
        return (self.shared_head.norm(out) if self.recycle_norm else out), out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of a pre-norm output (`layer`'s second value). The target's lm_head
        is frozen in the training dtype (bf16 under mixed precision), and a validation that decodes
        runs outside autocast: the input takes the table's dtype, as autocast would."""
        return self.lm_head(self.shared_head.norm(out).to(self.lm_head.weight.dtype))

    def step(self, hidden, input_ids, position_ids, mask=None, past=None):
        """`Eagle3Head.step`'s contract, for the chain drafter: (hidden to feed back, logits, None)."""
        feed, out = self.layer(hidden, input_ids, position_ids, mask, past)
        return feed, self.logits(out), None

    def draft_token_ids(self) -> torch.Tensor:
        """Target id of each draft id: the whole vocabulary, in order."""
        return torch.arange(self.vocab_size, device=self.eh_proj.weight.device)

    # ---- folder format ------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, state: dict | None = None) -> Path:
        config = {k: self.config.to_dict()[k] for k in CONFIG_KEYS}
        return save_head(out_dir, self.kind, config, self.target, self.trained_state(state))

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model, target_name: str) -> MtpHead:
        """Load a saved head against `target_model`; refuse one trained for another target."""
        config, spec, tensors = load_head(path, cls.kind)
        spec.check(TargetSpec.from_model(target_model, target_name), f"head={str(path)!r}")
        return build(config, spec, tensors, target_model, f"head={str(path)!r}")


def build(config: dict, spec: TargetSpec, tensors: dict, target_model, where: str) -> MtpHead:
    """A head from its config and trained tensors (its own names), the tables from `target_model`."""
    head = MtpHead(config, spec)
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if not k.startswith(FROZEN)]
    if missing or unexpected:
        raise UserError(f"{where}: missing {missing}, unexpected {unexpected}")
    if target_model is not None:
        head.share_target_tables(target_model)
    else:  # the export CLI's self-check, without the target: stand-in tables, equal in every build
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for table in (head.embed_tokens.weight, head.lm_head.weight):
                table.copy_(torch.randn(table.shape, generator=g))
    return head.eval()


def load_for_decoding(path: str | Path, target_model, target_name: str) -> tuple[MtpHead, object]:
    """(head, the model that verifies its drafts)."""
    return MtpHead.from_pretrained(path, target_model, target_name), target_model


def shipped_head(target_model, target_name: str, trained: MtpHead) -> MtpHead:
    """The target's MTP layer as shipped (`HeadKind.shipped_head`), over as many steps as the
    `trained` head drafts: the evaluator's baseline beside the fine-tuned layer."""
    cfg = MtpConfig(num_steps=trained.config.num_steps)
    return MtpHead.from_target(target_model, target_name, cfg).eval()
