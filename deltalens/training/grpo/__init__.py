"""GRPO through TRL's `GRPOTrainer` (`train`), with every hyperparameter in `GRPOConfig` (`config`,
torch-free). Import from the submodules; this package file imports nothing."""
