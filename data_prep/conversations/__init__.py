"""Stage 1, conversations -> token rows.

In: `data.source` (a JSONL file, a `datasets` dataset, the packaged ShareGPT set), read as
`sources.Sample`s in one shape. Out: the samples a folder selects (`rows.select_samples`) and each
one's training rows, `(row uid, Tokenized)`, from the conversation as it is (`rows.iter_rows`) or
from the turns the answers stage wrote (`rows.regenerated_rows`). `ranks` shares the conversations
among torchrun's processes by their prompt, for every later stage.

Imports the base modules of `data_prep` only (the target, its chat template, `stats`)."""
