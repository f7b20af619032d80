"""How much a run trains on and for how long: decided once, then only read.

A user may give the sizes (`data.max_samples`, `optim.epochs`, `optim.val_every`,
`optim.max_steps`), leave them to the defaults, or leave them to the main job's time budget
(`trainer.plan`, a pure planner over rates measured on the machine). Whichever decides, the result
is one frozen `Sizes`; `Sizes.apply` hands it on as a derived config (`conf.schema.derive`, so the
values are checked like any override) and the checked config itself is never written. Stages that
read a size read it from `Sizes.of(cfg)`, which gives the same answer for a derived config and
for a user's config whose sizes were left to the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from conf.schema import DataConfig, OptimConfig, RootConfig, derive


@dataclass(frozen=True)
class Sizes:
    conversations: int  # conversations read from the source; 0 = all
    answers: int  # answers per conversation (data.regenerate.num_samples)
    epochs: int
    val_every: int  # optimizer steps between validations
    max_steps: int = 0  # 0: epochs x steps per epoch
    # A `time.perf_counter()` value by which training ends (the budget's guard), or None. Not a
    # config value: a clock reading means nothing to another process or a resumed run.
    deadline: float | None = None

    @classmethod
    def of(cls, cfg: RootConfig) -> Sizes:
        """The sizes `cfg` asks for, each left unset taking its default: `DEFAULT_SAMPLES`
        conversations, the head's `DEFAULT_EPOCHS`, validation every `DEFAULT_VAL_EVERY` steps."""
        d, o = cfg.data, cfg.optim
        epochs = o.epochs if o.epochs is not None else cfg.head.DEFAULT_EPOCHS if cfg.head else 1
        return cls(
            conversations=DataConfig.DEFAULT_SAMPLES if d.max_samples is None else d.max_samples,
            answers=d.regenerate.num_samples,
            epochs=epochs,
            val_every=OptimConfig.DEFAULT_VAL_EVERY if o.val_every is None else o.val_every,
            max_steps=o.max_steps,
        )

    def apply(self, cfg: RootConfig) -> RootConfig:
        """`cfg` with these sizes filled in: a new, checked config (`cfg` is left as it was)."""
        return derive(cfg, {
            "data.max_samples": self.conversations,
            "data.regenerate.num_samples": self.answers,
            "optim.epochs": self.epochs,
            "optim.val_every": self.val_every,
            "optim.max_steps": self.max_steps,
        })
