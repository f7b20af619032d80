"""What data prep and draftsmith's vLLM connector (`data_prep.states.vllm_connector`, imported inside the
vLLM process) agree on, kept apart so that neither imports the other's dependencies."""

# The connector, as vLLM's `kv_transfer_config` names it.
SYNC_CONNECTOR = "SyncHiddenStatesConnector"
SYNC_CONNECTOR_MODULE = "data_prep.states.vllm_connector"
# The stock connector (CUDA only): the reference on GPUs.
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# A request's `kv_transfer_params` key asking for its hidden states: draftsmith's connector writes
# only the requests that ask, so that regeneration through the same server leaves no files.
ASK = "draftsmith_hidden_states"
