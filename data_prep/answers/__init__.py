"""Stage 2, conversations -> the target's own answers (`data.regenerate`).

In: the selected `Sample`s, the target and its chat template. Out: each conversation's turns as
prompt ids and generated ids (`template.Turn`), appended to the answer cache as they finish
(`regenerate`), which the conversations stage turns into rows. One backend answers: draftsmith's
continuous-batching engine (`regen_engine`, with its CPU decode kernel `decode_attention` and its
fitted step cost `regen_cost`), vLLM in this process (`regen_vllm`) or the user's running servers
(`regen_server`). With one pass, the engine hands each answer's hidden states to a
`regenerate.KeptStates`, which the states stage implements.

Imports the conversations stage and the base modules."""
