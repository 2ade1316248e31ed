"""Evolution Strategies fine-tuning: seeded in-place population search over the full parameter vector.

Qiu et al., "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning" (arXiv
2509.24372), in the setup arXiv 2608.27351 uses to compare what ES and GRPO change in the weights.
Defaults are the paper's: N = 32, σ = 1.5e-3, α = 2.5e-4, P = 64 prompts, greedy decoding, z-scored
rewards, θ += (α/N) Σ z_i ε_i.

    config       ESConfig: every hyperparameter (one help line each), presets (torch-free)
    strategy     noise seeds, member layout, fitness shaping, update arithmetic (knows no evaluator)
    noise        noise families (registered by name) and `Perturber`: θ + s·ε and Σ c_k ε_k, once for all paths
    engine       ESEngine: one model replica (perturb in place, score, restore, update)
    lowrank      EGGROLL-style rank-r noise on 2-D weights (a noise family)
    population   several members per batched generation
    backends     who evaluates members: local, ray, vllm (one protocol; the engine imports none)
    train        the loop: metrics, checkpoints, exact resume

Import from the submodules (`from deltalens.training.es.config import ESConfig`): this package file
imports nothing, so the configs load without torch (the CLI builds its options from them).
"""
