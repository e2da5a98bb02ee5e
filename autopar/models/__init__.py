"""Reference models (DESIGN §6, a CONTRACT): Megatron GPT and Llama-3."""
