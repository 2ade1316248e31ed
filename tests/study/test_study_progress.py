"""The study's entropy and diversity steps report progress like its training and evaluations: a bar per step,
opened with its total, advanced as sequences are sampled and scored, ending at the total (on SmolLM2 each
step ran ~10 min without a line before)."""

from __future__ import annotations

from pathlib import Path

from support import tiny_spec

from deltalens.study.config import StudyConfig
from deltalens.study.diversity import diversity_task
from deltalens.study.executor import TaskContext
from deltalens.study.measures import Measures, close_all


class Bars:
    """A progress_factory that records each bar's description, total and every update."""

    def __init__(self):
        self.bars: list[dict] = []

    def __call__(self, desc, total):
        bar = {"desc": desc, "total": total, "done": []}
        self.bars.append(bar)
        return lambda done, _total=None: bar["done"].append(done)


def _advances_to_its_total(bar) -> bool:
    d = bar["done"]
    return len(d) >= 2 and d == sorted(d) and d[-1] == bar["total"]


def test_entropy_reports_sampling_then_scoring(tmp_path):
    bars = Bars()
    cfg = StudyConfig(model=tiny_spec(), task="arith", limit=2, samples=2, k=(1, 2), entropy_prompts=3)
    m = Measures(cfg, tmp_path, log=lambda s: None, progress_factory=bars)
    ent = m.entropy(tiny_spec(), "base")
    assert len(ent) == 3
    [bar] = bars.bars
    assert bar["desc"].startswith("entropy base") and bar["total"] == 2 * 3 * 4  # 3 prompts x 4 samples, twice
    assert _advances_to_its_total(bar) and 3 * 4 in bar["done"]  # sampling ends at the halfway mark
    m.entropy(tiny_spec(), "base")  # cached: no work, no bar
    assert len(bars.bars) == 1


def test_diversity_task_reports_members_and_centre(tmp_path, rand_model_dir):
    from deltalens.training.es.config import ESConfig
    from deltalens.training.es.train import train_es

    run = train_es(ESConfig(model=str(rand_model_dir), task="arith", population=4, sigma=0.05, alpha=0.05,
                            prompts_per_iteration=4, max_new_tokens=4, iterations=1, eval_every=0),
                   tmp_path / "runs" / "es-s0")
    cfg = StudyConfig(model=str(rand_model_dir), task="arith", limit=2, samples=2, k=(1, 2), diversity_members=3,
                      diversity_prompts=2)
    bars = Bars()
    assert Path(run) == tmp_path / "runs" / "es-s0"  # where the study keeps its runs
    ctx = TaskContext(root=tmp_path, deps={},
                      log=lambda s: None, progress=bars)
    try:
        div = diversity_task(ctx, cfg, "es-s0")
    finally:
        close_all()
    assert div["members"] == 3
    [bar] = bars.bars
    assert bar["desc"].startswith("diversity es-s0") and bar["total"] == 2 * 3 + 1  # sample, score, centre
    assert _advances_to_its_total(bar)
