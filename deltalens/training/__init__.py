"""Training: ES (`es/`), GRPO through TRL (`grpo/`), chains of both (`chain`), FLOP-matched budgets
(`budget`), the run plumbing they share (`run`) and the entry points the CLI calls (`launch`)."""
