"""Ray backend: same weights as the in-process backend, bit for bit, even when a worker dies mid-iteration."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

ray = pytest.importorskip("ray")

from support import assert_same_weights, final_weights, tiny_spec

from deltalens.io.runs import RunDir
from deltalens.training.es.config import ESConfig
from deltalens.training.es.train import train_es

FAST = {"population": 4, "prompts_per_iteration": 8, "sigma": 0.01, "alpha": 0.005, "eval_every": 0,
        "max_new_tokens": 48}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_matches_local_and_survives_a_dead_worker(ray_cluster, tmp_path):
    spec = tiny_spec()
    torch.set_num_threads(1)  # the actors run one thread each: same forward pass everywhere
    cfg = ESConfig(model=spec, iterations=3, checkpoint_every=0, **FAST)
    local = train_es(cfg, tmp_path / "local")
    # worker 0 is handed member 0 first and dies on it in iteration 2; the member is re-run elsewhere
    # and a replacement joins with the driver's weights
    ray_run = train_es(replace(cfg, backend="ray", workers=2), tmp_path / "ray",
                       backend_options={"fail_at": (2, 0)})
    assert_same_weights(final_weights(local), final_weights(ray_run))
    lrows, rrows = RunDir(local).metrics(), RunDir(ray_run).metrics()
    assert [r["rewards"] for r in lrows] == [r["rewards"] for r in rrows]
    assert [r["checksum"] for r in lrows] == [r["checksum"] for r in rrows]
    assert rrows[1]["workers"]["restarts"] == 1
    assert rrows[-1]["workers"]["live"] == 2
