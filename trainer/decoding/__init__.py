"""The built-in speculative decoder: pure acceptance/tree rules, drafters and one loop."""

from trainer.decoding.baselines import greedy_generate, prompt_lookup_generate
from trainer.decoding.decoder import DecodeStats, Generation, speculative_generate
from trainer.decoding.drafters import (
    Chain,
    Draft,
    Eagle3Drafter,
    MedusaDrafter,
    OracleDrafter,
    Tree,
)

__all__ = [
    "Chain",
    "DecodeStats",
    "Draft",
    "Eagle3Drafter",
    "Generation",
    "MedusaDrafter",
    "OracleDrafter",
    "Tree",
    "greedy_generate",
    "prompt_lookup_generate",
    "speculative_generate",
]
