"""Stage 3, token rows -> the target's hidden states.

In: `Tokenized` rows and a `capture.CaptureSpec` (which layers, in what dtype, the top-1 or not).
Out: per row the fields a head trains on (auxiliary layers, the final state, the target's top-1),
from the transformers target (`capture`), from vLLM in this process or its servers
(`capture_engine`; inside vLLM, draftsmith's connector `vllm_connector`, with the names both sides
share in `connector_names`), or from the states the answers engine kept in one pass (`onepass`).

Imports the answers stage (the servers' client in `regen_server`), the conversations stage and
the base modules."""
