"""The evaluator: prompts (`tasks`), speculative vs plain decoding (`run`), the report (`report`)."""
