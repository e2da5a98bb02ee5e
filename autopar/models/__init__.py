"""Reference models (docs/design.md §3, a contract): Megatron GPT and Llama-3."""
