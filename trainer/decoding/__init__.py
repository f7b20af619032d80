"""The built-in speculative decoder: pure acceptance/tree rules, drafters and one loop."""

from trainer.decoding.baselines import greedy_generate, prompt_lookup_generate, reference_generate
from trainer.decoding.decoder import DecodeStats, Generation, pooled_per_position, speculative_generate
from trainer.decoding.drafters import (
    Chain,
    Draft,
    Eagle3Drafter,
    MedusaDrafter,
    OracleDrafter,
    Tree,
)
from trainer.decoding.verify import GREEDY, Sampling

__all__ = [
    "GREEDY",
    "Chain",
    "DecodeStats",
    "Draft",
    "Eagle3Drafter",
    "Generation",
    "MedusaDrafter",
    "OracleDrafter",
    "Sampling",
    "Tree",
    "greedy_generate",
    "pooled_per_position",
    "prompt_lookup_generate",
    "reference_generate",
    "speculative_generate",
]
