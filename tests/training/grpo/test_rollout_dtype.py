"""GRPO's rollout dtype: training completions sampled on a bf16 copy of the fp32 policy (`compute_dtype`),
ended at EOS or at a stop string, while the update stays fp32; auto resolves once and a resume keeps it."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from support import max_weight_diff, tiny_spec

import deltalens.generation.dtype as dtype_mod
from deltalens.errors import DeltalensError
from deltalens.generation import HFBackend, SamplingParams
from deltalens.generation.params import cut_ids_at_stop, decode_completion
from deltalens.tasks import get_task
from deltalens.training.grpo.config import GRPOConfig
from deltalens.training.grpo.train import grpo_compute_dtype, sample_rollouts, train_grpo


def fast(**kw) -> GRPOConfig:
    base = {"model": tiny_spec(), "prompts_per_step": 4, "num_generations": 4, "learning_rate": 1e-3,
            "steps": 2, "eval_every": 0, "eval_limit": 4, "save_every": 1, "max_new_tokens": 48}
    return GRPOConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny():
    from deltalens.io.models import load_model

    model, tok = load_model(tiny_spec())
    model.eval()
    return model, tok


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(spec) -> dict[str, torch.Tensor]:
    from deltalens.io.models import load_model

    model, _ = load_model(str(spec))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- the pieces


def test_cut_ids_at_stop_keeps_eos_or_the_stop_strings_last_token(tiny):
    _, tok = tiny
    ids = tok.encode("7. 8\n\nQ: 1+1", add_special_tokens=False)
    cut = cut_ids_at_stop(tok, ids, ("\n\nQ:",))
    assert tok.decode(cut) == "7. 8\n\nQ:"  # through the token that completes the stop string
    assert decode_completion(tok, cut, ("\n\nQ:",)) == "7. 8"  # whose text is what the reward reads
    assert cut_ids_at_stop(tok, ids, ("#",)) == ids  # no stop string: all of it
    assert cut_ids_at_stop(tok, ids + [tok.eos_token_id] + ids, ()) == ids + [tok.eos_token_id]  # EOS kept
    assert cut_ids_at_stop(tok, ids, ("7",)) == ids[:1]
    assert cut_ids_at_stop(tok, [], ("7",)) == []


def test_sample_rollouts_groups_trls_rows_and_matches_the_backend(tiny):
    """TRL's rows hold each prompt G times in a row: generated as n = G per distinct prompt, in TRL's order;
    greedy, each row's completion is the backend's own (EOS kept)."""
    model, tok = tiny
    gen = HFBackend(model, tok)
    prompts = [p.prompt for p in get_task("arith").test(3)]
    enc = gen.encode(prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    rows = [e for e in enc for _ in range(4)]
    got = sample_rollouts(gen, rows, 4, params)
    want = [c[0] for c in gen.generate(prompts, params)]
    assert len(got) == 12
    assert [decode_completion(tok, ids) for ids in got] == [w for w in want for _ in range(4)]
    assert all(ids[-1] == tok.eos_token_id for ids in got if len(ids) < 40)  # ended: EOS is the last token
    assert sum(tok.eos_token_id in ids for ids in got) >= 1
    # rows not laid out in groups: one completion each, same greedy answers
    mixed = [enc[0], enc[1], enc[0], enc[2]]
    assert [decode_completion(tok, ids) for ids in sample_rollouts(gen, mixed, 2, params)] == \
        [want[0], want[1], want[0], want[2]]


def test_sample_rollouts_end_at_the_stop_string(tiny):
    model, tok = tiny
    gen = HFBackend(model, tok)
    prompts = [p.prompt for p in get_task("arith").test(4)]
    rows = [e for e in gen.encode(prompts) for _ in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=3, stop=("=",))
    got = sample_rollouts(gen, rows, 3, params)
    texts = [tok.decode(ids) for ids in got]
    ended = [t for t in texts if "=" in t]
    assert len(ended) >= 6  # tiny writes " a+b=c. ...": most rows reach an "=" within 48 tokens
    assert all(t.endswith("=") and t.count("=") == 1 for t in ended)  # nothing after the stop string
    again = sample_rollouts(gen, rows, 3, params)
    assert again == got  # seeded


def test_auto_resolves_by_width_and_cpu_and_a_pin_wins(tiny, monkeypatch):
    model, _ = tiny
    assert grpo_compute_dtype(fast(), model) == "fp32"  # tiny: hidden 128, no gain from bf16
    assert grpo_compute_dtype(fast(compute_dtype="bf16"), model) == "bf16"
    assert grpo_compute_dtype(fast(compute_dtype="bf16"), model, pinned="fp32") == "fp32"  # a resume
    wide = type("M", (), {})()
    wide.config = type("C", (), {"hidden_size": 576})()
    wide.parameters = lambda: iter([torch.zeros(1)])
    monkeypatch.setattr(dtype_mod, "bf16_is_fast", lambda device="cpu": True)
    assert grpo_compute_dtype(fast(), wide) == "bf16"
    monkeypatch.setattr(dtype_mod, "bf16_is_fast", lambda device="cpu": False)  # AVX2 only
    assert grpo_compute_dtype(fast(), wide) == "fp32"
    wide.parameters = lambda: iter([torch.zeros(1, dtype=torch.bfloat16)])
    assert grpo_compute_dtype(fast(), wide) == "bf16"  # bf16 weights generate as they are


@pytest.mark.parametrize("kw, msg", [
    ({"compute_dtype": "fp16"}, "compute_dtype must be auto, fp32 or bf16"),
    ({"compute_dtype": "bf16", "dtype": "bf16"}, "--compute-dtype auto"),
])
def test_config_refuses_what_cannot_be_honoured(kw, msg):
    with pytest.raises(DeltalensError, match=msg):
        fast(**kw)


# ---------------------------------------------------------------------------------------------- whole runs


def test_bf16_rollouts_train_fp32_weights_and_resume_exactly(tmp_path, monkeypatch):
    """compute_dtype bf16: every step's completions come from the backend (`generate_ids`, on the bf16
    copy), the weights move and stay fp32, state.json and every row record bf16, and a killed run resumes
    to the same bits as an uninterrupted one."""
    calls = []
    generate_ids = HFBackend.generate_ids

    def spy(self, enc, params, progress=None):
        calls.append((self.dtype, len(enc), params.n, params.seed))
        return generate_ids(self, enc, params, progress)

    monkeypatch.setattr(HFBackend, "generate_ids", spy)
    cfg = fast(steps=4, save_every=2, compute_dtype="bf16", eval_every=2)
    straight = tmp_path / "straight"
    train_grpo(cfg, straight)
    rollouts = [c for c in calls if c[2] == 4]  # the held-out evaluations are n = 1
    assert len(rollouts) == 4 and all(c[0] == torch.bfloat16 and c[1] == 4 for c in rollouts)
    assert len({c[3] for c in rollouts}) == 4  # reseeded per step
    rows = _rows(straight)
    assert all(r["compute_dtype"] == "bf16" for r in rows)
    assert rows[0]["iteration"] == 0 and "eval" in rows[0]
    st = json.loads((straight / "state.json").read_text())
    assert st["compute_dtype"] == "bf16"
    final = _weights(straight)
    assert all(v.dtype == torch.float32 for v in final.values())
    assert max_weight_diff(final, _weights(cfg.model)) > 1e-4

    class Killed(Exception):
        pass

    def kill_at_3(done, total, row):
        if done == 3:
            raise Killed

    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        train_grpo(cfg, killed, progress=kill_at_3)
    train_grpo(cfg, killed, resume=True)
    b = _weights(killed)
    assert all(torch.equal(final[k], b[k]) for k in final)
    assert [r["reward_mean"] for r in _rows(killed) if "reward_mean" in r] == \
        [r["reward_mean"] for r in rows if "reward_mean" in r]


def test_fp32_rollouts_are_trls_own_and_old_runs_resume_as_fp32(tmp_path, monkeypatch):
    """auto on tiny is fp32: TRL's generate samples, the backend is not asked for rollouts. A run from
    before the option (state.json without compute_dtype) resumes in fp32 even where auto would say bf16."""
    calls = []
    monkeypatch.setattr(HFBackend, "generate_ids",
                        lambda self, *a, **k: calls.append(1) or pytest.fail("rollouts went through the backend"))
    out = tmp_path / "run"
    train_grpo(fast(steps=2, save_every=1), out)
    assert not calls
    st = json.loads((out / "state.json").read_text())
    assert st["compute_dtype"] == "fp32"
    assert all(r["compute_dtype"] == "fp32" for r in _rows(out))

    # an old run: its checkpoint's state has no compute_dtype; auto would now say bf16
    (out / "state.json").write_text(json.dumps({k: v for k, v in st.items() if k != "compute_dtype"}))
    monkeypatch.setattr(dtype_mod, "bf16_is_fast", lambda device="cpu": True)
    monkeypatch.setattr(dtype_mod, "MIN_BF16_HIDDEN", 1)
    train_grpo(fast(steps=3, save_every=1), out, resume=True)
    assert not calls
    assert _rows(out)[-1]["compute_dtype"] == "fp32"
