"""The LLM engine that runs inside the decoupled Triton Python-backend model: its parts (`config`, `layers`, `models`,
`core`, `processing`) and the glue over them (`llm_engine`, `triton_io`, `triton_metrics`)."""
