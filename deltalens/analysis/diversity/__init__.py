"""Population diversity: Jensen-Shannon divergence across ES members, and the coverage it buys.

arXiv 2608.27351 asks why an ES population (Qiu et al., arXiv 2509.24372: N members θ_i = θ + σ ε_i)
covers more problems than its centre. For a model θ (a checkpoint, or an ES run's centre at some
iteration) and a task, this package measures, per held-out prompt: the policy JS across members over whole
responses (one estimator reported, named in analysis.json's `estimator`), the verifier-projected JS of
success (plug-in and permutation-corrected), the population's coverage against the centre's, the centre's
token entropy, and optionally the small-σ law over a σ sweep. Read top to bottom:

    estimators.py   the formulas (JS by two unbiased estimators and which one is reported, verifier JS
                    and its permutation null, coverage); pure, tested against hand computations
    sampling.py     sampling and teacher-forced scoring on token ids (temperature, EOS, batching)
    populations.py  N policies: explicit models, or ES members rebuilt exactly from a run's noise
    divergence.py   the estimate over prompts: two passes over the members, then the centre
    sweep.py        the small-σ law: Fisher trace, JS over σ, the paired check
    section.py      the analysis.json section (`diversity_section`) and document (`diversity_analysis`)

Departures / choices: the own sampler (sampling.py); the paper's formulas are written with plug-in success
rates, we report the plug-in `js_succ` beside the corrected one, and the unbiased estimator for the centre's
coverage; additions: the posterior-entropy JS estimator (the one reported), `js_se_prompts`, token entropy at
T = 1, the drawn-noise and paired forms of the law, `cost` / `timing` / `notes` fields.
"""

from deltalens.analysis.diversity.divergence import Progress, population_divergence
from deltalens.analysis.diversity.estimators import (
    ESTIMATOR,
    ESTIMATOR_LABEL,
    binary_entropy,
    coverage,
    js_from_logprobs,
    js_success,
    js_success_null,
)
from deltalens.analysis.diversity.populations import (
    ESPopulation,
    ModelPopulation,
    Population,
    load_population,
)
from deltalens.analysis.diversity.sampling import (
    _seed,
    encode_prompts,
    problem_ids,
    sample_responses,
    sequence_logprobs,
)
from deltalens.analysis.diversity.section import diversity_analysis, diversity_section
from deltalens.analysis.diversity.sweep import fisher_trace, sigma_sweep

__all__ = [
    "ESTIMATOR",
    "ESTIMATOR_LABEL",
    "ESPopulation",
    "ModelPopulation",
    "Population",
    "Progress",
    "_seed",
    "binary_entropy",
    "coverage",
    "diversity_analysis",
    "diversity_section",
    "encode_prompts",
    "fisher_trace",
    "js_from_logprobs",
    "js_success",
    "js_success_null",
    "load_population",
    "population_divergence",
    "problem_ids",
    "sample_responses",
    "sequence_logprobs",
    "sigma_sweep",
]
