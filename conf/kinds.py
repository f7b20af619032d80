"""The head kinds' configs: one frozen dataclass per kind, the `head.*` keys of `+head=<kind>`.

They have a module of their own because a kind's config is a subclass of its parent's: every kind
inherits the shared objective (`ObjectiveConfig`), P-EAGLE subclasses EAGLE-3 and DSpark
subclasses DFlash, so a field is declared, checked and documented once, in the class that
introduces it. Each field is documented here and only here, by the comment beside it or the
block just above it: `--help` (`conf.usage`) reads its meaning from this source, and
`conf/head/<kind>.yaml` lists, without comments, only the knobs a user tunes, at the defaults
below (`tests/unit/conf/test_config.py` holds them equal). `conf.schema` imports `HEAD_CONFIGS`
from here; both check their values with `conf.checked`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from conf.checked import Checked, probability

# The per-row training losses (`trainer/objective.py`).
LOSSES = ("ce", "tv", "ce+tv", "lk")


# ---- what every kind shares: where training starts, and the objective ---------------------------


@dataclass(frozen=True)
class ObjectiveConfig(Checked):
    """The objective knobs every head kind shares (`trainer/objective.py`), and where training
    starts (`init_from`); each kind's config inherits them, so they are `head.*` overrides."""

    PREFIX: ClassVar[str] = "head"
    # A head folder to start from (draftsmith's, or a speculators/EAGLE-3/Medusa export); null: a
    # fresh head. Two-stage fine-tuning: `heads.formats` reads an engine's export (a speculators or
    # native EAGLE-3 one, Medusa's) as well as draftsmith's own. Its kind, target and architecture
    # (aux layers, norm flags, sizes) must be this run's: a mismatch is refused in one line naming
    # the field.
    init_from: str | None = None
    # Rows that train: 0 = the answer tokens only; w = prompt/template positions too, at weight w.
    # Every other real position (prompt, system and template tokens) then weighs w against the
    # answers' 1 (1 = every position alike); DFlash draws its anchors and labels from them too.
    # Capture keeps hidden states at every position, so the data folder serves any w as it is.
    prompt_loss_weight: float = 0.0
    # The per-row loss: ce | tv (1 - sum min(p, q)) | ce+tv (ce + tv_weight * tv) | lk (KL->TV per row).
    # Cross-entropy is to the target's distribution (Medusa's: to the data's token); tv is the
    # chance that speculative sampling rejects one drafted token; lk is lam * KL + (1 - lam) * tv
    # per row, with lam = exp(-lk_eta * acceptance): KL's gradient while the acceptance is low,
    # TV's after.
    loss: str = "ce"
    tv_weight: float = 1.0  # ce+tv only: tv's weight beside ce
    lk_eta: float = 3.0  # lk only: lam = exp(-lk_eta * acceptance)

    def check(self) -> None:
        self._require("init_from", lambda v: v is None or bool(str(v).strip()), "null or a head folder")
        self._require(
            "prompt_loss_weight",
            lambda v: 0 <= v <= 1,
            "a value in [0, 1] (0: answer tokens only, 1: every position alike)",
        )
        self._one_of("loss", LOSSES)
        self._require("tv_weight", lambda v: v > 0, "a value > 0")
        self._require("lk_eta", lambda v: v > 0, "a value > 0")


# ---- EAGLE-3 and P-EAGLE: architecture knobs first, then the objective's -----------------------


@dataclass(frozen=True)
class Eagle3Config(ObjectiveConfig):
    """Hydra group `head/eagle3`: what a user may choose about a new EAGLE-3 head."""

    PREFIX: ClassVar[str] = "head"
    # optim.epochs when it is null: the field's 2-3 passes over regenerated data. On the embedded
    # default 2 epochs over 560 conversations beat 5 over 192 and 1 over 600 (τ 1.322 vs 1.307
    # and 1.268, 2026-12-01).
    DEFAULT_EPOCHS: ClassVar[int] = 2
    name: str = "eagle3"
    # Architecture. The 3 target layers the head reads, as HF hidden_states indices; null = (2, N//2, N-3).
    # Index k is the residual stream after k decoder layers. null is the engines' default, or
    # distinct ids where those collide (fewer than 7 layers: `heads.eagle3.model.default_aux_layer_ids`);
    # checked against the target's N when the target's config is read.
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = None  # the draft layer's MLP width; null = the target's
    num_attention_heads: int | None = None  # its attention heads; null = the target's
    num_key_value_heads: int | None = None  # its key/value heads; null = the target's
    # Layer variants, as vLLM's `llama_eagle3` and speculators name them (all false = the original
    # EAGLE-3 layout). On by default: on the embedded default's data and steps (192 conversations,
    # 117 steps) they raised vLLM's acceptance length on 40 prompts from 1.179 to 1.197
    # (2026-11-30). fc_norm in place of norm_before_fc scored lower there (vLLM τ 1.253 vs 1.262,
    # 2026-12-02), so it is off. The two are exclusive here (speculators refuses both on,
    # TensorRT-LLM would apply only fc_norm): norm_before_fc null (the default) is on unless fc_norm
    # is, so that EAGLE 3.1 is one override (`head.fc_norm=true`, or `+head=eagle3.1`), resolved to a
    # bool when the config is built. A head folder saved without them still reads as all off
    # (`heads.eagle3.model.norm_flags`).
    norm_before_fc: bool | None = None  # one RMSNorm over the fused 3*H features before fc; null: not fc_norm
    fc_norm: bool = False  # or one RMSNorm per aux layer before fc, in its place (EAGLE 3.1)
    norm_before_residual: bool = True  # the residual is the normed feature (taken after hidden_norm)
    norm_output: bool = True  # feed the post-norm hidden back between draft steps (EAGLE 3.1)
    # Rows that train, as the shared objective's, but EAGLE-3 trains every position alike (1).
    # The shared default is the answers only.
    prompt_loss_weight: float = 1.0
    # Objective. Test-time-training steps: match them to the draft tokens you serve (the evaluator: 3).
    # Three is what the evaluator and the serve commands draft: on the embedded default it beat 7 and
    # tied 4 at the lowest cost (vLLM τ on 40 prompts: 1.242 at 3, 1.241 at 4, 1.220 at 7;
    # 2026-11-30). Serving more draft tokens wants as many steps.
    ttt_length: int = 3
    step_weight: float = 0.8  # loss weight of draft step k = 0, 1, ...: step_weight**k (P-EAGLE: slot k + 1)
    # Draft attention over the last W positions (>= 16), trained, decoded and exported; null = all.
    # The engines read it from every export (`heads.window`).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.norm_before_fc is None:  # fc_norm (EAGLE 3.1) takes the fused norm's place
            object.__setattr__(self, "norm_before_fc", not self.fc_norm)
        super().__post_init__()

    def check(self) -> None:
        super().check()
        self._require(
            "aux_layer_ids",
            lambda v: v is None or (len(set(v)) == 3 and min(v) >= 0),
            "null or 3 distinct HF hidden_states indices >= 0",
        )
        self._optional_positive("intermediate_size", "num_attention_heads", "num_key_value_heads")
        self._require(
            "fc_norm",
            lambda v: not (v and self.norm_before_fc),
            f"false with {self._key('norm_before_fc')}=true (one norm before fc or the other: "
            f"drop {self._key('norm_before_fc')}=true, or set it false)",
        )
        self._require("step_weight", probability, "a value in (0, 1]")
        self.check_steps()

    def check_steps(self) -> None:
        """The draft steps it trains: the TTT unroll's length (`PEagleConfig` has slots instead)."""
        self._at_least(1, "ttt_length")
        self._window("ttt_length")


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """Hydra group `head/peagle`: an EAGLE-3 head that drafts `parallel_tokens` tokens in one
    forward (P-EAGLE, arXiv 2602.01469; vLLM's `parallel_drafting`). Slot 1 is EAGLE-3's first
    step; slots 2..K read a mask token and a learned hidden state (`heads.peagle.model`). Everything
    else is EAGLE-3's: the layers; the variants (norm_before_fc norms `mask_hidden` too, fc_norm
    exports as format=peagle only, norm_output is the layer's output, which no step reads back in
    one forward); the loss; and `step_weight`, the weight of slot k being step_weight**(k-1)."""

    PREFIX: ClassVar[str] = "head"
    name: str = "peagle"
    # K: tokens drafted in one forward (slot 1 = EAGLE-3's, 2..K mask slots) = num_speculative_tokens served.
    # The slots trained per anchor. 3 = the tokens the evaluator drafts (eval.num_speculative_tokens),
    # as EAGLE-3's ttt_length.
    parallel_tokens: int = 3
    # Input id of the mask slots 2..K; null = the target's pad token, else its eos. It is embedded
    # with the target's (shared, frozen) embedding. The null case is where both peers' resolution
    # ends for a tokenizer with no mask token and no unused embedding rows (SmolLM2: 2). Sharing an
    # id with real text is harmless: a mask slot's hidden is the learned `mask_hidden`, never a
    # target feature.
    mask_token_id: int | None = None
    # Share of anchors whose mask slots train per batch (the rest train slot 1 only); < 1 bounds the cost.
    # It bounds the (K-1) x anchors extra rows on long sequences. At 1 every anchor trains them, as
    # EAGLE-3's unroll trains every position; the peers keep ~0.7^(k-1) of them at slot k, floor 0.2,
    # on GPUs.
    anchor_fraction: float = 1.0
    ttt_length: int | None = None  # null: no TTT unroll, the head drafts its parallel_tokens slots at once

    def check_steps(self) -> None:
        self._require(
            "ttt_length",
            lambda v: v is None,
            "null: a peagle head drafts its slots in one forward; set head.parallel_tokens",
        )
        self._require(
            "parallel_tokens", lambda v: v >= 2, "an integer >= 2 (slot 1 alone is an EAGLE-3 head)"
        )
        self._window("parallel_tokens")
        self._require("mask_token_id", lambda v: v is None or v >= 0, "null or a token id >= 0")
        self._require("anchor_fraction", probability, "a value in (0, 1]")


# ---- Medusa ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MedusaConfig(ObjectiveConfig):
    """Hydra group `head/medusa`."""

    PREFIX: ClassVar[str] = "head"
    # optim.epochs when it is null: one pass over the default 560 conversations. Medusa's four
    # full-vocabulary heads are slow to train on a CPU (`bench_train.py +head=medusa`: ~160-200
    # tokens/s against EAGLE-3's ~1,000, 2026-12-02), so a second pass would not fit the
    # 20-minute main job (3 passes over 192 conversations were the old default).
    DEFAULT_EPOCHS: ClassVar[int] = 1
    name: str = "medusa"
    # Architecture.
    num_heads: int = 4  # heads predict tokens t+2 .. t+1+num_heads
    num_layers: int = 1  # ResBlocks per head
    fc_bias: bool = True  # bias on the ResBlock linears (original Medusa / TGI layout; vLLM medusa_fc_bias)
    joint: bool = False  # true = Medusa-2: train the target with the heads (tokens-only data)
    lora_rank: int = 0  # joint only: > 0 = LoRA (peft) on the target instead of full fine-tuning
    # Objective.
    head_weight: float = 0.8  # loss weight of head k: lambda_k = head_weight**k
    head_lr_scale: float = 4.0  # joint only: the heads' lr = optim.lr * head_lr_scale
    joint_head_loss_scale: float = 0.2  # joint only: loss = LM loss + scale * sum_k head_weight**k CE_k
    head_warmup_steps: int = 0  # joint only: first steps train the heads on detached target states
    self_distill: bool = True  # joint only: the LM loss is KL to the original target's distribution

    def check(self) -> None:
        super().check()
        self._at_least(1, "num_heads", "num_layers")
        self._require(
            "lora_rank",
            lambda v: v == 0 or (v > 0 and self.joint),
            "0, or > 0 together with head.joint=true",
        )
        self._require("head_weight", probability, "a value in (0, 1]")
        self._require("head_lr_scale", lambda v: v > 0, "a value > 0")
        self._at_least(0, "joint_head_loss_scale", "head_warmup_steps")


# ---- DFlash and DSpark ----------------------------------------------------------------------

# How a DFlash block's positions weigh in its loss (`trainer/kinds/dflash.py`): decay =
# exp(-(k-1)/loss_decay) for the k-th drafted slot (the DFlash paper's, SpecForge's and
# speculators' default); dpace = D-PACE, each slot weighted by the expected acceptance it still
# leads to, from the head's own confidence on the target's token (speculators' option).
POSITION_WEIGHTS = ("decay", "dpace")


@dataclass(frozen=True)
class DFlashConfig(ObjectiveConfig):
    """Hydra group `head/dflash`: a block drafter (Chen et al., "DFlash", arXiv 2602.06036) as
    vLLM 0.32 serves it (`qwen3_dflash.py`): Qwen3 decoder layers whose context K/V come from the
    target's aux-layer features through `fc` + `hidden_norm`, drafting a block of `block_size`
    positions (the last accepted token, then mask tokens) in one forward: block_size - 1 tokens.
    Its objective draws random anchors per sample, with soft targets from the target's
    distribution."""

    PREFIX: ClassVar[str] = "head"
    # optim.epochs when it is null: as EAGLE-3's, whose data folder DFlash shares (same aux
    # layers, the final hidden state for the teacher).
    DEFAULT_EPOCHS: ClassVar[int] = 2
    name: str = "dflash"
    # Architecture. Qwen3-style draft layers (published heads: 5, for 8B targets). Two train in the
    # 20-minute CPU budget on SmolLM2-135M.
    num_layers: int = 2
    # Anchor + block_size - 1 mask slots: drafts block_size - 1 tokens (vLLM's num_speculative_tokens).
    # The anchor is the last accepted token; vLLM does not read the block size. The default 4
    # drafts 3, the evaluator's and EAGLE-3's chain.
    block_size: int = 4
    # Attention in a block: false = every slot sees the whole block (DFlash's own), true = causal.
    # Causal: each slot sees the slots before it. Written to the export as dflash_config.causal.
    causal: bool = False
    # HF hidden_states indices like EAGLE-3's; null = EAGLE-3's (2, N//2, N-3), so both share a data folder.
    # `heads.eagle3.model.resolve_aux_layer_ids` resolves them. Export writes vLLM's
    # dflash_config.target_layer_ids, one lower.
    aux_layer_ids: list[int] | None = None
    # Input id of the mask slots; null = the tokenizer's mask token, else an unused embedding row.
    # After those come its unk, pad or EOS token: `heads.dflash.model.default_mask_token_id` picks a
    # token chat rows do not hold. It is embedded with the target's (frozen) embeddings.
    mask_token_id: int | None = None
    # The layers' width is the target's hidden size (vLLM shares the target's embeddings and lm_head).
    intermediate_size: int | None = None  # the draft layers' MLP width; null = the target's
    num_attention_heads: int | None = None  # their attention heads; null = the target's
    num_key_value_heads: int | None = None  # their key/value heads; null = the target's
    # Objective. Blocks drawn per sample at random answer positions (the anchors).
    anchors_per_sample: int = 32
    # Slot weights: decay = exp(-(k-1)/loss_decay) at drafted slot k | dpace = D-PACE's (`POSITION_WEIGHTS`).
    position_weights: str = "decay"
    loss_decay: float = 4.0  # decay only: its constant
    dpace_alpha: float = 0.5  # dpace only: D-PACE's smoothing of the head's confidence, in [0, 1]
    # Draft attention over the last W positions (>= 16), as EAGLE-3's (`heads.window`); null = all.
    sliding_window: int | None = None

    def check(self) -> None:
        super().check()
        self._at_least(1, "num_layers", "anchors_per_sample")
        self._require(
            "block_size", lambda v: v >= 2, "an integer >= 2 (vLLM drafts block_size - 1 >= 1 tokens)"
        )
        self._require(
            "aux_layer_ids",
            lambda v: v is None or (len(v) >= 1 and len(set(v)) == len(v) and min(v) >= 0),
            "null or distinct HF hidden_states indices >= 0",
        )
        self._require("mask_token_id", lambda v: v is None or v >= 0, "null or a token id >= 0")
        self._optional_positive("intermediate_size", "num_attention_heads", "num_key_value_heads")
        self._one_of("position_weights", POSITION_WEIGHTS)
        self._require("loss_decay", lambda v: v > 0, "a value > 0")
        self._require("dpace_alpha", lambda v: 0 <= v <= 1, "a value in [0, 1]")
        self._window("block_size")


# DSpark's Markov head kinds as the peers name them (speculators' --markov-head-type). vLLM 0.32
# serves "vanilla" only: its Qwen3 DSpark model holds markov_w1 and markov_w2 and nothing of the
# gated head's gate or the rnn head's state, so only vanilla is trained here.
MARKOV_HEADS = ("vanilla",)


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """Hydra group `head/dspark`: DFlash plus a Markov logit bias and a confidence head (DSpark, as
    vLLM 0.32 serves `method: dspark`, `qwen3_dspark.py`, `heads/dspark/`): slot k's logits gain
    markov_w2 . markov_w1[the token drawn at slot k-1], a rank-`markov_rank` bigram correction that
    makes each draft depend on the one before it; the confidence head predicts each slot's
    acceptance (what vLLM's adaptive verification reads). Everything else is DFlash's."""

    name: str = "dspark"
    markov_rank: int = 256  # rank of the bias markov_w2 . markov_w1[previous token]
    markov_head_type: str = "vanilla"  # vanilla, the one vLLM 0.32 loads (`MARKOV_HEADS`)
    # Also train the per-slot acceptance predictor vLLM's adaptive verification reads.
    # The confidence head is sigmoid(proj([hidden ; markov_w1[prev]])), trained by BCE against the
    # slot's overlap with the target, 1 - TV, detached. The defaults of markov_rank (256) and
    # confidence_weight (1.0) are speculators' and SpecForge's.
    confidence_head: bool = True
    confidence_with_markov: bool = True  # it reads [hidden ; markov_w1[prev]] (false: the hidden alone)
    confidence_weight: float = 1.0  # its BCE's weight beside the draft's loss

    def check(self) -> None:
        super().check()
        self._at_least(1, "markov_rank")
        self._one_of("markov_head_type", MARKOV_HEADS)
        self._require("confidence_weight", lambda v: v >= 0, "a value >= 0")


# ---- MTP: the target's own multi-token-prediction layer ------------------------------------

# Where an MTP head's weights start: the target's shipped MTP layer, or a fresh init.
MTP_INITS = ("native", "scratch")
# Where a recursive step's rows sit in rotary positions (`trainer/kinds/mtp.py`).
MTP_STEP_POSITIONS = ("drafted", "anchor")


@dataclass(frozen=True)
class MtpConfig(ObjectiveConfig):
    """Hydra group `head/mtp`: the target's own MTP layer (DeepSeek-V3, GLM-4.5: `heads.mtp`),
    read from its checkpoint and fine-tuned with the embedding and lm_head frozen and shared,
    recursively over `num_steps` draft steps (FastMTP, arXiv 2509.18362; speculators'
    `--speculator-type mtp`); vLLM serves it as method "mtp"."""

    PREFIX: ClassVar[str] = "head"
    # optim.epochs when it is null: as EAGLE-3's (the data folder holds the same final states).
    DEFAULT_EPOCHS: ClassVar[int] = 2
    name: str = "mtp"
    init: str = "native"  # native: the target's shipped MTP weights | scratch: a fresh init (`MTP_INITS`)
    # Draft steps trained: step k reads step k-1's output and the token k+1 ahead (= num_speculative_tokens).
    # The evaluator and the serve line draft as many. speculators' and FastMTP's default is 3.
    num_steps: int = 3
    # Step weights beta**k / sum_j beta**j, k = 0..num_steps-1 (FastMTP's Eq. 2, speculators' 0.6).
    step_weight_beta: float = 0.6
    # Rotary position of step k's row t: drafted = t + k, where vLLM drafts it | anchor = t (speculators').
    step_positions: str = "drafted"

    def check(self) -> None:
        super().check()
        self._one_of("init", MTP_INITS)
        self._one_of("step_positions", MTP_STEP_POSITIONS)
        self._at_least(1, "num_steps")
        self._require("step_weight_beta", probability, "a value in (0, 1]")


# The head config groups by name (`+head=<name>`); each kind's record (`heads.kinds`) holds the rest.
HEAD_CONFIGS: dict[str, type] = {
    cls.name: cls for cls in (Eagle3Config, MedusaConfig, PEagleConfig, DFlashConfig, DSparkConfig, MtpConfig)
}
