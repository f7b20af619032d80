"""The training side of draftsmith: target loading, the Hydra trainer, the evaluator."""
