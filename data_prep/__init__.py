"""Conversations -> chat-templated token ids, loss masks and captured target hidden states.

One folder per stage, in the order a conversation goes through them; a stage imports only the
base modules here and earlier stages (tests/unit/test_layers.py):
1. `conversations`: sources -> the selected samples and their token rows;
2. `answers`: the target's own answers to them (the regeneration backends and the engine);
3. `states`: the target's hidden states over the rows (the capture backends, one pass, the
   vLLM connector);
4. `folders`: the data folder, built, named, read back, and fed to the trainer.
Base modules, which every stage uses: `target` (with `resident`), `template`, `stats`, `masks`,
`linears`, `vllm_engine`. The entry points run the stages: `python -m data_prep.prepare` and
`python -m data_prep.show`."""
