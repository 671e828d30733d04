"""Training draft models for speculative decoding: the prompt set (`prompts`), self-distillation data from
the target (`data`) and the draft trainer with the specjax draft format (`draft`: `save_draft`, `load_draft`)."""
