"""Training: ES (`es/`), GRPO through TRL (`grpo/`), the registry of methods (`methods`: name -> config,
trainer, budget unit), chains of them (`chain`), FLOP-matched budgets (`budget`), the run plumbing they
share (`run`) and the entry points the CLI calls (`launch`)."""
