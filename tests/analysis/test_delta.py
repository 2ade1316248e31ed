"""deltalens.delta: known-answer metrics, group/layer aggregation from sums, top-k, ties, warnings, CLI."""

import json
import math

import pytest
import torch
import typer
from typer.testing import CliRunner

from deltalens.analysis import delta
from deltalens.analysis.delta import diff_analysis, diff_checkpoints, diff_sources, param_group
from deltalens.errors import DeltalensError
from deltalens.io.atomic import save_state_dict
from deltalens.io.source import DictSource
from deltalens.schema import validate

Q0, Q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
K0, DOWN1 = "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"
NORM, EMB, HEAD = "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"


def known_pair():
    """Base/checkpoint with hand-picked deltas (embed/lm_head tied by storage on both sides)."""
    base = {
        EMB: torch.tensor([[0.1, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]),
        Q0: torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        K0: torch.ones(2, 2),
        Q1: torch.ones(2, 2),
        DOWN1: torch.full((2, 3), 2.0),
        NORM: torch.ones(3),
    }
    base[HEAD] = base[EMB]
    d = {k: torch.zeros_like(v) for k, v in base.items() if k != HEAD}
    d[EMB][0, 0] = 0.4     # rel 4.0: the top relative change
    d[Q0][0, 1] = 0.5      # abs 0.5, rel 0.25
    d[K0][0, 0] = 0.05     # below tol=0.1
    d[K0][0, 1] = -0.2     # rel 0.2
    d[Q1][1, 1] = 0.125
    d[DOWN1][1, 2] = -1.0  # the top |Δ|, rel 0.5
    d[NORM][0] = 0.3       # rel 0.3
    ckpt = {k: base[k] + d[k] for k in d}
    ckpt[HEAD] = ckpt[EMB]
    return base, ckpt, d


def test_param_group_naming():
    cases = {
        "model.embed_tokens.weight": ("embed", None), "lm_head.weight": ("lm_head", None),
        "model.layers.3.self_attn.q_proj.weight": ("attn_q", 3),
        "model.layers.3.self_attn.k_proj.weight": ("attn_k", 3),
        "model.layers.3.self_attn.v_proj.weight": ("attn_v", 3),
        "model.layers.3.self_attn.o_proj.weight": ("attn_o", 3),
        "model.layers.3.self_attn.q_proj.bias": ("attn_bias", 3),        # Qwen2
        "model.layers.12.mlp.gate_proj.weight": ("mlp_gate", 12),
        "model.layers.12.mlp.up_proj.weight": ("mlp_up", 12),
        "model.layers.12.mlp.down_proj.weight": ("mlp_down", 12),
        "model.layers.0.input_layernorm.weight": ("norm", 0),
        "model.layers.0.post_attention_layernorm.weight": ("norm", 0),
        "model.layers.0.pre_feedforward_layernorm.weight": ("norm", 0),   # Gemma 2/3
        "model.layers.0.self_attn.q_norm.weight": ("norm", 0),           # Gemma 3 / Qwen3
        "model.norm.weight": ("norm", None),
        "model.layers.0.self_attn.rotary_emb.inv_freq": ("other", 0),
        # GPT-2
        "transformer.wte.weight": ("embed", None), "transformer.wpe.weight": ("embed", None),
        "transformer.h.5.attn.c_attn.weight": ("attn_qkv", 5),
        "transformer.h.5.attn.c_attn.bias": ("attn_bias", 5),
        "transformer.h.5.attn.c_proj.weight": ("attn_o", 5),
        "transformer.h.5.attn.bias": ("other", 5),                        # causal-mask buffer
        "transformer.h.5.mlp.c_fc.weight": ("mlp_up", 5),
        "transformer.h.5.mlp.c_fc.bias": ("mlp_up", 5),
        "transformer.h.5.mlp.c_proj.weight": ("mlp_down", 5),
        "transformer.h.5.ln_1.weight": ("norm", 5), "transformer.ln_f.bias": ("norm", None),
        "something.else": ("other", None),
    }
    for name, want in cases.items():
        assert param_group(name) == want, name
        assert want[0] in delta.GROUPS


def _close(m, **want):
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k


def test_known_answer_metrics():
    base, ckpt, d = known_pair()
    r = diff_sources(DictSource(base), DictSource(ckpt), tol=0.1, topk=3)
    # per tensor
    t = {e["name"]: e for e in r["tensors"]}
    assert HEAD not in t  # tied: counted once, under the embedding
    _close(t[Q0], n=4, l2=0.5, base_l2=math.sqrt(30), rel_l2=0.5 / math.sqrt(30), max_abs=0.5, mean_abs=0.125,
           frac_changed=0.25, frac_above_tol=0.25)
    _close(t[K0], n=4, l2=math.sqrt(0.05**2 + 0.2**2), base_l2=2.0, max_abs=0.2, mean_abs=0.25 / 4,
           frac_changed=0.5, frac_above_tol=0.25)
    assert t[Q0]["group"] == "attn_q" and t[Q0]["layer"] == 0 and t[Q0]["shape"] == [2, 2]
    # groups and layers come from sums of squares, not averaged norms
    _close(r["groups"]["attn_q"], n=8, l2=math.sqrt(0.5**2 + 0.125**2), base_l2=math.sqrt(30 + 4),
           max_abs=0.5, frac_changed=2 / 8)
    layers = {(x["layer"], x["group"]): x for x in r["layers"]}
    assert list(layers) == [(0, "attn_q"), (0, "attn_k"), (1, "attn_q"), (1, "mlp_down"), (None, "embed"),
                            (None, "norm")]
    _close(layers[(1, "attn_q")], n=4, l2=0.125, base_l2=2.0, rel_l2=0.0625)
    all_d = torch.cat([v.reshape(-1) for v in d.values()])
    all_b = torch.cat([v.reshape(-1) for k, v in base.items() if k != HEAD])
    _close(r["whole"], n=all_d.numel(), l2=float(all_d.norm()), base_l2=float(all_b.norm()),
           rel_l2=float(all_d.norm() / all_b.norm()), max_abs=1.0, mean_abs=float(all_d.abs().mean()),
           frac_changed=7 / all_d.numel(), frac_above_tol=6 / all_d.numel())
    assert r["n_params"] == all_d.numel() == 8 + 4 * 3 + 6 + 3
    assert r["dtype"] == "float32" and r["tol"] == 0.1
    assert r["tied"] == [[EMB, HEAD]] and r["warnings"] == []
    # top-k by |Δ| and by |Δ|/|θ0|, with group composition
    top = r["topk"]
    assert top["k"] == 3
    assert [(e["name"], e["index"]) for e in top["abs"]["entries"]] == [(DOWN1, 5), (Q0, 1), (EMB, 0)]
    first = top["abs"]["entries"][0]
    assert first["delta"] == pytest.approx(-1.0) and first["base"] == 2.0
    assert top["abs"]["composition"] == {"embed": 1, "attn_q": 1, "mlp_down": 1}
    assert [(e["name"], e["index"]) for e in top["rel"]["entries"]] == [(EMB, 0), (DOWN1, 5), (NORM, 0)]
    assert top["rel"]["composition"] == {"embed": 1, "mlp_down": 1, "norm": 1}


def test_chunking_gives_same_answer(monkeypatch):
    g = torch.Generator().manual_seed(1)
    base = {Q0: torch.randn(37, 11, generator=g), NORM: torch.randn(53, generator=g)}
    ckpt = {k: v + torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.5)
            for k, v in base.items()}
    whole = diff_sources(DictSource(base), DictSource(ckpt), topk=20)
    monkeypatch.setattr(delta, "CHUNK", 7)
    chunked = diff_sources(DictSource(base), DictSource(ckpt), topk=20)
    for k in delta.METRIC_KEYS:
        assert chunked["whole"][k] == pytest.approx(whole["whole"][k], rel=1e-5)
    assert chunked["topk"] == whole["topk"]
    # and the top-k is the exact top-k of the concatenated deltas
    dd = torch.cat([(ckpt[k] - base[k]).reshape(-1) for k in (Q0, NORM)])
    assert [e["delta"] for e in whole["topk"]["abs"]["entries"]] == pytest.approx(
        dd[dd.abs().argsort(descending=True)[:20]].tolist())


@pytest.mark.parametrize("chunk,block", [(5, 1024), (64, 1024), (1 << 22, 1024), (64, 2), (1 << 22, 3)])
def test_reduction_matches_naive_reference(monkeypatch, chunk, block):
    """The fused, buffer-reusing reduction against plain formulas: counts, sums, both top-k lists
    and the zero-base count, on tensors with unchanged coordinates, zero bases and ties at tol.
    Small blocks send the top-k candidate search through above_indices' block path."""
    monkeypatch.setattr(delta, "CHUNK", chunk)
    monkeypatch.setattr(delta, "BLOCK", block)
    g = torch.Generator().manual_seed(3)
    base, ckpt = {}, {}
    for name, shape in [(Q0, (31, 9)), (NORM, (40,)), (DOWN1, (12, 17)), (EMB, (3, 5))]:
        b = torch.randn(shape, generator=g)
        b[torch.rand(shape, generator=g) < 0.1] = 0.0                      # exact zero bases
        step = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-6, 0, shape, generator=g)
        step[torch.rand(shape, generator=g) < 0.3] = 0.0                   # unchanged coordinates
        base[name], ckpt[name] = b, b + step
    ckpt[Q0].view(-1)[:4] = base[Q0].view(-1)[:4] + 0.25                   # |Δ| == tol exactly: not above
    tol, k = 0.25, 15
    r = diff_sources(DictSource(base), DictSource(ckpt), tol=tol, topk=k)
    b = torch.cat([base[n].reshape(-1) for n in base]).double()
    d = torch.cat([(ckpt[n] - base[n]).reshape(-1) for n in base]).double()   # Δ as float32 computes it
    a = d.abs()
    w = r["whole"]
    assert w["n"] == d.numel()
    assert w["frac_changed"] * d.numel() == pytest.approx(int((a > 0).sum()), abs=1e-6)
    assert w["frac_above_tol"] * d.numel() == pytest.approx(int((a > tol).sum()), abs=1e-6)
    assert w["l2"] == pytest.approx(float(d.norm()), rel=1e-6)
    assert w["mean_abs"] == pytest.approx(float(a.mean()), rel=1e-6)
    assert w["max_abs"] == pytest.approx(float(a.max()), rel=1e-7)
    assert [abs(e["delta"]) for e in r["topk"]["abs"]["entries"]] == pytest.approx(
        a[a > 0].sort(descending=True).values[:k].tolist(), rel=1e-6)
    ok = (b != 0) & (a > 0)
    rel = (a[ok] / b[ok].abs()).sort(descending=True).values[:k]
    got = [abs(e["delta"]) / abs(e["base"]) for e in r["topk"]["rel"]["entries"]]
    assert got == pytest.approx(rel.tolist(), rel=1e-5)
    n_zero = int(((b == 0) & (a > 0)).sum())
    assert n_zero > 0 and any(w_.startswith(f"{n_zero} changed coordinates have base value 0")
                              for w_ in r["warnings"])


def tied_pair(seed: int = 11):
    """Base/checkpoint with repeated values (ties in |Δ| and in |Δ|/|θ0|), zero and subnormal bases
    (whose ratio overflows) and unchanged coordinates, in tensors whose sizes do not divide a row."""
    g = torch.Generator().manual_seed(seed)
    base, ckpt = {}, {}
    for name, shape in [(EMB, (50, 41)), (Q0, (37, 29)), (DOWN1, (64, 64)), (NORM, (7,))]:
        b = (torch.randn(shape, generator=g) * 0.02).round(decimals=3)
        b[torch.rand(shape, generator=g) < 0.05] = 0.0
        b.view(-1)[:3] = torch.tensor([1e-39, -1e-42, 1e-30])[:b.numel()]
        step = (torch.randn(shape, generator=g) * 1e-3).round(decimals=5)
        step[torch.rand(shape, generator=g) < 0.3] = 0.0
        base[name], ckpt[name] = b, b + step
    return base, ckpt


@pytest.mark.parametrize("lanes,dense,k", [(16, 1.0, 40), (4, 1.0, 40), (3, 1 / 16, 40), (16, 0.0, 40),
                                           (16, 1.0, 1), (5, 1.0, 400)])
def test_filtered_topk_matches_full_pass(monkeypatch, lanes, dense, k):
    """Once a top-k list is full, each chunk is narrowed by a one-pass filter (column maxima of |Δ|;
    |θ0| <= max|Δ| / threshold) before scoring: the entries, their order among ties, the zero-base
    count and every metric are exactly those of scoring every coordinate (GROUPED_MIN above any
    chunk). dense=0 sends every filtered chunk back to the full pass; dense=1 never."""
    base, ckpt = tied_pair()
    monkeypatch.setattr(delta, "CHUNK", 512)
    monkeypatch.setattr(delta, "GROUPED_MIN", 1 << 30)                  # every chunk scored in full
    want = diff_sources(DictSource(base), DictSource(ckpt), tol=1e-4, topk=k)
    calls = {"sparse": 0, "grouped": 0}
    for fn, key in (("_rank_rel_sparse", "sparse"), ("_grouped_above", "grouped")):
        real = getattr(delta, fn)

        def spy(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(delta, fn, spy)
    monkeypatch.setattr(delta, "GROUPED_MIN", 1)
    monkeypatch.setattr(delta, "LANES", lanes)
    monkeypatch.setattr(delta, "DENSE", dense)
    got = diff_sources(DictSource(base), DictSource(ckpt), tol=1e-4, topk=k)
    assert calls["sparse"] > 5 and calls["grouped"] > 0               # the filtered paths did run
    assert got == want
    scores = [abs(e["delta"]) / abs(e["base"]) for e in got["topk"]["rel"]["entries"]]
    assert len(scores) == k and (k == 1 or len(set(scores)) < k)       # ties among the entries
    assert any(" changed coordinates have base value 0" in w for w in got["warnings"])


def test_relative_filter_bound_is_tight():
    """The relative list's filter |θ0| <= tau = fl32(max|Δ| / threshold) keeps a coordinate with
    |θ0| == tau exactly whose ratio still beats the threshold (found by search): a filter one float32
    step tighter, or a strict <, would lose it."""
    n = 1 << 15                                                         # chunks above GROUPED_MIN
    base = {Q0: torch.ones(n), K0: torch.ones(n)}
    ckpt = {Q0: base[Q0].clone(), K0: base[K0].clone()}
    ckpt[Q0][5] = 8.3                                                   # first chunk fills the list (k=1)
    thr = ckpt[Q0][5] - base[Q0][5]                                     # its ratio: the threshold after it
    a, up = torch.tensor(3.1e-4), torch.tensor(1.0)
    for _ in range(1000):                                               # |Δ| = a, |θ0| = tau
        tau = torch.tensor(float(a) / float(thr))
        if bool(a / tau > thr) and bool((tau + a) - tau == a):
            break
        a = torch.nextafter(a, up)
    else:
        pytest.fail("no |Δ| with a ratio above the threshold at |θ0| = tau")
    base[K0][n - 9], ckpt[K0][n - 9] = tau, tau + a                     # second chunk: the only change
    r = diff_sources(DictSource(base), DictSource(ckpt), topk=1)
    e = r["topk"]["rel"]["entries"][0]
    assert (e["name"], e["index"], e["base"]) == (K0, n - 9, float(tau))


@pytest.mark.parametrize("n,lanes", [(100, 4), (1000, 7), (4096, 16), (50, 16), (10, 16)])
def test_grouped_above_matches_nonzero(monkeypatch, n, lanes):
    """The |Δ| list's search from column maxima finds exactly x > thr, ascending, including a column
    whose max beats thr by one float32 step and the tail that does not fill a row."""
    monkeypatch.setattr(delta, "LANES", lanes)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).abs()
    cols = n // lanes
    x_max = x[:cols * lanes].view(lanes, cols).amax(0)
    edge = float(torch.nextafter(x_max[0], torch.tensor(0.0))) if cols else 1.0
    for thr in (0.0, float(x.median()), edge, float(x.max()) - 1e-6, 10.0):
        assert torch.equal(delta._grouped_above(x, x_max, thr), torch.nonzero(x > thr).squeeze(1))


@pytest.mark.parametrize("n,block", [(100, 4), (1000, 7), (4096, 64), (50, 1024)])
def test_above_indices_matches_nonzero(monkeypatch, n, block):
    monkeypatch.setattr(delta, "BLOCK", block)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for thr in (-10.0, 0.0, 1.5, 2.5, 10.0):                    # all, half, few, rare, none above
        assert torch.equal(delta.above_indices(x, thr), torch.nonzero(x > thr).squeeze(1))


@pytest.mark.parametrize("piece,chunk,svd", [(7, 5, 0), (7, 5, 2), (64, 1 << 18, 0), (1 << 21, 3, 0)])
def test_streamed_pieces_match_in_memory(tmp_path, monkeypatch, piece, chunk, svd):
    """safetensors files stream in PIECE-sized read-ahead jobs (2-D tensors whole when svd is on);
    the result (metrics, top-k indices, warnings, svd) is the in-memory diff's, whatever PIECE and
    CHUNK are."""
    g = torch.Generator().manual_seed(5)
    base = {EMB: torch.randn(13, 8, generator=g), Q0: torch.randn(9, 7, generator=g),
            NORM: torch.ones(5), "model.layers.0.self_attn.q_proj.bias": torch.zeros(0),
            "model.rotary.inv_freq_ids": torch.arange(6)}
    base[EMB][0, :3] = 0.0                                            # zero bases (relative top-k skip)
    ckpt = {k: (v + torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.6)
                if v.is_floating_point() else v.clone()) for k, v in base.items()}
    ckpt[NORM] = ckpt[NORM].bfloat16()                                # dtype mismatch, compared in fp32
    ckpt[Q0][2, 3] = float("nan")
    ckpt["model.rotary.inv_freq_ids"][0] = 7
    save_state_dict(base, tmp_path / "b.safetensors")
    save_state_dict(ckpt, tmp_path / "c.safetensors")
    want = diff_sources(DictSource(base), DictSource(ckpt), tol=0.1, topk=25, svd=svd)
    monkeypatch.setattr(delta, "PIECE", piece)
    monkeypatch.setattr(delta, "CHUNK", chunk)
    from deltalens.io.tensors import open_tensors

    with open_tensors(tmp_path / "b.safetensors") as sb, open_tensors(tmp_path / "c.safetensors") as sc:
        assert sb.partial_reads
        got = diff_sources(sb, sc, tol=0.1, topk=25, svd=svd)
    assert got["topk"] == want["topk"] and got["warnings"] == want["warnings"]
    got_by_name = {t["name"]: t for t in got["tensors"]}                # file order is by name
    assert len(got_by_name) == len(want["tensors"])
    for w in want["tensors"]:
        h = got_by_name[w["name"]]
        assert w.keys() == h.keys() and w["shape"] == h["shape"] and w["dtype"] == h["dtype"]
        for k in delta.METRIC_KEYS:
            assert h[k] == (None if w[k] is None else pytest.approx(w[k], rel=1e-5))   # None: empty
        if "svd" in w:
            assert h["svd"]["top"] == pytest.approx(w["svd"]["top"], rel=1e-5)
            assert h["svd"]["effective_rank"] == pytest.approx(w["svd"]["effective_rank"], rel=1e-5)
        else:
            assert "svd" not in h
    for k in delta.METRIC_KEYS:
        assert got["whole"][k] == pytest.approx(want["whole"][k], rel=1e-5)


def test_prefetched_arena_keeps_regions_until_released():
    """The read-ahead ring hands out each job's region, never reuses it before the consumer moved
    on, wraps around, re-raises reader errors, and stops its thread when the consumer quits early."""
    sizes = [64 * (1 + (7 * i) % 23) for i in range(200)]          # 64 B .. 1.4 KB, in a 64 MB arena
    sizes[50] = 64 * 2**20                                          # one job as large as the arena
    seen = []
    unbuffered = [(j, r) for j, r in delta._prefetched([0, 1, 2], lambda j, r: r, lambda j: 64, buffered=False)]
    assert unbuffered == [(0, None), (1, None), (2, None)]          # accounting only: load gets None

    def load(job, region):
        region.fill_(job % 251)
        return region

    for job, region in delta._prefetched(list(range(len(sizes))), load, lambda j: sizes[j]):
        assert region.numel() == sizes[job] and bool((region == job % 251).all())
        seen.append(job)
    assert seen == list(range(len(sizes)))

    arena = delta._Arena(256)                                       # wrap-around bookkeeping
    a, b = arena.take(128), arena.take(64)
    assert b.data_ptr() == a.data_ptr() + 128
    arena.release()                                                 # frees a: [0, 128)
    c = arena.take(128)                                             # does not fit after b: wraps to 0
    assert c.data_ptr() == a.data_ptr()
    assert arena._start(64) is None                                 # wrapped: free is [head, tail) = []
    arena.release()                                                 # frees b
    assert arena._start(128) == 128                                 # c stays; after it [128, 256) is free
    arena.release()
    assert arena._start(256) == 0 and not arena.regions

    def failing(job, region):
        if job == 3:
            raise OSError("disk gone")
        return region

    with pytest.raises(OSError, match="disk gone"):
        for _ in delta._prefetched(list(range(10)), failing, lambda j: 64):
            pass
    gen = delta._prefetched(list(range(1000)), load, lambda j: 32 * 2**20)   # 2 jobs fill the arena
    next(gen)
    gen.close()                                                     # reader blocked in take(): must exit
    assert not any(t.name == "deltalens-read" for t in __import__("threading").enumerate())


def test_relative_overflow_does_not_take_a_topk_slot():
    """|Δ|/|θ0| overflows to inf against a subnormal base: never ranked, and the finite ratios behind it
    still fill the list (found in review: an inf used to take a slot while the list filled up)."""
    base = {Q0: torch.tensor([1e-39, 1.0, 1.0, 1.0])}
    ckpt = {Q0: torch.tensor([1e-39 + 1.0, 1.5, 1.3, 1.0])}
    r = diff_sources(DictSource(base), DictSource(ckpt), topk=2)
    assert [e["index"] for e in r["topk"]["rel"]["entries"]] == [1, 2]
    assert [e["index"] for e in r["topk"]["abs"]["entries"]] == [0, 1]   # |Δ| itself is finite


def test_nan_inf_reported_and_excluded():
    base = {Q0: torch.ones(4), NORM: torch.ones(2)}
    ckpt = {Q0: torch.tensor([1.0, float("nan"), float("inf"), 2.0]), NORM: torch.ones(2)}
    r = diff_sources(DictSource(base), DictSource(ckpt))
    assert r["whole"]["n"] == 4 and r["whole"]["l2"] == 1.0 and math.isfinite(r["whole"]["mean_abs"])
    assert any("NaN/Inf" in w and Q0 in w and "checkpoint 2" in w for w in r["warnings"])


def test_mismatches_warn_or_raise():
    base = {Q0: torch.ones(2, 2), K0: torch.ones(2, 2), NORM: torch.ones(3), "old.weight": torch.ones(1),
            "model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}
    ckpt = {Q0: torch.ones(2, 2) * 2, K0: torch.ones(3, 2), NORM: torch.ones(3).bfloat16(),
            "new.weight": torch.ones(1), "model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}
    r = diff_sources(DictSource(base), DictSource(ckpt))
    text = "\n".join(r["warnings"])
    assert "missing from the checkpoint (1): old.weight" in text
    assert "not in the base (1): new.weight" in text
    assert f"shape differs (skipped) (1): {K0} [2, 2] vs [3, 2]" in text
    assert f"dtype differs (compared in float32) (1): {NORM} float32 vs bfloat16" in text
    assert r["n_params"] == 4 + 3 + 4 and r["dtype"] == "float32+bfloat16"
    with pytest.raises(DeltalensError, match="does not match base"):
        diff_sources(DictSource(base), DictSource(ckpt), strict=True)


def test_zero_base_excluded_from_relative_topk():
    bias = "model.layers.0.self_attn.q_proj.bias"
    r = diff_sources(DictSource({bias: torch.zeros(3)}), DictSource({bias: torch.tensor([0.0, 0.01, 0.0])}))
    assert r["groups"]["attn_bias"]["rel_l2"] is None  # ||θ0|| = 0
    assert r["topk"]["rel"]["entries"] == [] and len(r["topk"]["abs"]["entries"]) == 1
    assert any("1 changed coordinates have base value 0" in w for w in r["warnings"])


def test_tied_on_one_side():
    e = torch.ones(3, 2)
    base = DictSource({EMB: e}, config={"tie_word_embeddings": True})   # HF file without lm_head
    ckpt = DictSource({EMB: e.clone(), HEAD: e + 1})                     # fine-tune untied them
    r = diff_sources(base, ckpt)
    t = {x["name"]: x for x in r["tensors"]}
    assert t[HEAD]["l2"] == pytest.approx(math.sqrt(6)) and t[EMB]["l2"] == 0
    assert r["n_params"] == 12 and r["tied"] == []
    assert any("tied on one side only" in w for w in r["warnings"])


def test_svd_flag():
    base = {Q0: torch.zeros(4, 3)}
    u, v = torch.tensor([1.0, 2.0, 0.0, 2.0]), torch.tensor([0.0, 3.0, 4.0])
    r = diff_sources(DictSource(base), DictSource({Q0: torch.outer(u, v)}), svd=2)
    s = r["tensors"][0]["svd"]
    assert s["top"][0] == pytest.approx(15.0) and s["top"][1] == pytest.approx(0.0, abs=1e-5)
    assert s["effective_rank"] == pytest.approx(1.0, abs=1e-4)
    assert "svd" not in diff_sources(DictSource(base), DictSource({Q0: torch.ones(4, 3)}))["tensors"][0]


def test_diff_files_ratios_and_document(tmp_path):
    base, ckpt, _ = known_pair()
    small = {k: base[k] + 0.5 * (ckpt[k] - base[k]) for k in base}
    paths = [save_state_dict(sd, tmp_path / f"{n}.safetensors") for n, sd in
             (("base", base), ("es", ckpt), ("grpo", small))]
    out = diff_checkpoints(paths[0], paths[1:], progress=False)
    assert list(out["diff"]) == ["es", "grpo"]
    assert out["ratios"] == [{"a": "es", "b": "grpo", "rel_l2_ratio": pytest.approx(2.0)}]
    es = out["diff"]["es"]
    assert es["tied"] == [[EMB, HEAD]] and es["n_params"] == 29
    mem = diff_sources(DictSource(base), DictSource(ckpt))
    assert es["whole"] == pytest.approx(mem["whole"])
    doc = diff_analysis(paths[0], paths[1:], ["a", "b"], progress=False)
    assert doc["schema_version"] == 1 and doc["base"] == {"label": "base", "path": str(paths[0])}
    assert doc["models"][0] == {"label": "a", "path": str(paths[1]), "kind": "checkpoint", "method": None}
    assert set(doc) == {"schema_version", "deltalens_version", "created", "base", "models", "diff", "ratios"}
    with pytest.raises(DeltalensError, match="labels must be unique"):
        diff_checkpoints(paths[0], paths[1:], labels=["x", "x"], progress=False)


def test_cli_diff(tmp_path):
    from cli import common
    from cli.diff import diff, sparsify

    app = typer.Typer()
    app.command("diff")(common.guard(diff))
    app.command("sparsify")(common.guard(sparsify))
    base, ckpt, _ = known_pair()
    b = save_state_dict(base, tmp_path / "base.safetensors")
    c = save_state_dict(ckpt, tmp_path / "es.pt")
    runner = CliRunner()
    res = runner.invoke(app, ["diff", str(b), str(c), "--json", str(tmp_path / "a.json"),
                              "--csv", str(tmp_path / "a.csv"), "--topk", "5", "--tol", "0.1"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "a.json").read_text())
    validate(doc)  # the analysis.json contract
    assert doc["diff"]["es"]["topk"]["k"] == 5 and doc["models"][0]["label"] == "es"
    assert doc["diff"]["es"]["whole"]["frac_above_tol"] == pytest.approx(6 / 29)
    rows = (tmp_path / "a.csv").read_text().splitlines()
    assert rows[0].startswith("label,level,name,group,layer,n,l2") and rows[1].startswith("es,whole")
    res = runner.invoke(app, ["diff", str(b), str(tmp_path / "missing.pt")])
    assert res.exit_code == 2 and "no such file" in res.output
    # a read error in the read-ahead thread: the same one-line error, exit 2, no JSON left behind
    raw = save_state_dict(ckpt, tmp_path / "c.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    head[Q1]["dtype"] = "F16"                                       # 8 bytes by shape, 16 in the file
    text = json.dumps(head, separators=(",", ":")).encode()
    (tmp_path / "bad.safetensors").write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])
    res = runner.invoke(app, ["diff", str(b), str(tmp_path / "bad.safetensors"), "--json", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "bad.safetensors: tensor" in res.output and "mis-sized" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("config", [{"model_type": "gemma3"}, {"model_type": "gemma3", "text_config":
                                                                  {"model_type": "gemma3_text"}}])
def test_gemma_norms_are_reported_against_the_stored_w_and_the_acting_one_plus_w(config, tmp_path):
    """Gemma's RMSNorm scales by 1 + w: the diff keeps the stored w everywhere and adds the norm group
    against the acting scale. Known answer: w0 = (1, 3), Δ = (0.3, 0.4): ||Δ|| = 0.5, ||w0|| = √10,
    ||1 + w0|| = √20; the base means 2 (stored) and 3 (acting)."""
    base = {"model.layers.0.input_layernorm.weight": torch.tensor([1.0, 3.0]),
            "model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}
    ckpt = {"model.layers.0.input_layernorm.weight": torch.tensor([1.3, 3.4]),
            "model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}
    r = diff_sources(DictSource(base, config=config), DictSource(ckpt, config=config), topk=3)
    nc = r["norm_convention"]
    assert nc["model_type"] == (config.get("text_config") or config)["model_type"]
    assert (nc["stored"], nc["acting"], nc["n"]) == ("w", "1 + w", 2)
    assert nc["l2"] == pytest.approx(0.5, rel=1e-6)
    assert nc["rel_l2_stored"] == pytest.approx(0.5 / math.sqrt(10), rel=1e-6)
    assert nc["rel_l2_acting"] == pytest.approx(0.5 / math.sqrt(20), rel=1e-6)
    assert (nc["base_mean_stored"], nc["base_mean_acting"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert r["groups"]["norm"]["rel_l2"] == pytest.approx(nc["rel_l2_stored"])  # the rest: stored w
    # the same pair from files, through the document and its schema, and the CLI's line
    from deltalens.analysis.document import analysis_document
    doc = analysis_document("base", [], diff={"g": r}, ratios=[])
    validate(doc)
    # a Llama (x * w) has no such entry
    plain = diff_sources(DictSource(base, config={"model_type": "llama"}), DictSource(ckpt), topk=3)
    assert "norm_convention" not in plain


def test_the_diff_command_prints_the_gemma_norm_convention(tmp_path):
    from deltalens.cli.main import app

    cfg = {"model_type": "gemma3_text", "tie_word_embeddings": False}
    for name, w in (("base", [1.0, 3.0]), ("ckpt", [1.3, 3.4])):
        d = tmp_path / name
        d.mkdir()
        save_state_dict({"model.layers.0.input_layernorm.weight": torch.tensor(w)}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["diff", str(tmp_path / "base"), str(tmp_path / "ckpt")])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "stored as w, acting as 1 + w" in out and "1.58e-01 of the stored w" in out \
        and "1.12e-01 of the acting 1 + w" in out, out
