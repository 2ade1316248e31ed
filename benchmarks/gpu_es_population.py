"""GPU check of population batching (deltalens.training.es.population) on one CUDA device: equality and throughput.

    python benchmarks/gpu_es_population.py [--members 32] [--prompts 64] [--new-tokens 64]

The HF ES engine draws its noise on the CPU (also with `--device cuda`), so this script builds member
tensors directly (random full-rank / low-rank perturbations, the shapes `member_weights` makes) and
exercises the member-aware forwards and segmented generation on the GPU:

1. equality, fp32 (TF32 off), a small Llama with biases and tied embeddings: logits of G members in one
   batch vs each member's weights materialised (full rank: bit-identical or not, and the max difference;
   low rank: the max relative difference);
2. throughput, bf16, a SmolLM2-135M-shaped random Llama (30 layers, hidden 576, vocab 49152, tied):
   response tokens/s of pure batched generation of the centre (batch N x P), of members one by one
   (weights materialised, P rows per call), and of batched full-rank and low-rank members (batch N x P).
   Every row generates exactly --new-tokens tokens (min_new_tokens), so all paths do the same work.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltalens.training.es.population import Members, _key, member_modules


def llama(dev, dtype, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**kw)).to(dev, dtype).eval()


def unique_params(model):
    seen = {}
    for p in model.parameters():
        seen.setdefault(_key(p), p)
    return list(seen.values())


def member_tensors(model, g, sigma, rank):
    """rank 0: stacked W + σε (full); rank r: (±σ/√r A, B) for 2-D tensors and stacks for the others."""
    out = {}
    for p in unique_params(model):
        if rank and p.dim() == 2:
            a = torch.randn(g, p.shape[0], rank, device=p.device) * (sigma / math.sqrt(rank))
            out[_key(p)] = (a.to(p.dtype), torch.randn(g, p.shape[1], rank, device=p.device).to(p.dtype))
        else:
            out[_key(p)] = (p.detach().float() + sigma * torch.randn(g, *p.shape, device=p.device)).to(p.dtype)
    return out


def materialise(model, weights, i):
    """Put member i's weights into the model in place; returns the originals to restore."""
    saved = []
    with torch.no_grad():
        for p in unique_params(model):
            v = weights[_key(p)]
            saved.append(p.detach().clone())
            if isinstance(v, torch.Tensor):
                p.copy_(v[i])
            else:
                p.copy_((p.float() + v[0][i].float() @ v[1][i].float().T).to(p.dtype))
    return saved


def restore(model, saved):
    with torch.no_grad():
        for p, s in zip(unique_params(model), saved):
            p.copy_(s)


@torch.no_grad()
def equality(dev) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = llama(dev, torch.float32, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True,
                  mlp_bias=True)
    ids = torch.randint(0, 256, (3, 9), device=dev)
    out = {}
    for name, rank in (("full", 0), ("lowrank_r2", 2)):
        w = member_tensors(model, 4, 0.05, rank)
        with member_modules(model, Members(w, 4)):
            bat = model(ids.repeat(4, 1)).logits.reshape(4, *ids.shape, -1)
        seq = []
        for i in range(4):
            saved = materialise(model, w, i)
            seq.append(model(ids).logits)
            restore(model, saved)
        seq = torch.stack(seq)
        out[name] = {"bit_identical": bool(torch.equal(seq, bat)), "max_abs_diff": float((seq - bat).abs().max()),
                     "max_rel_diff": float(((seq - bat).abs() / seq.abs().clamp_min(1e-3)).max())}
    return out


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


@torch.no_grad()
def throughput(dev, members: int, prompts: int, new_tokens: int, rank: int) -> dict:
    model = llama(dev, torch.bfloat16, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                  max_position_embeddings=2048)
    ids = torch.randint(0, 49152, (prompts, 32), device=dev)
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0,
          "eos_token_id": None, "temperature": None, "top_p": None, "top_k": None}

    def gen(x):
        return model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)

    gen(ids[:2])  # warm-up
    tokens = members * prompts * new_tokens
    res = {"pure": timed(lambda: gen(ids.repeat(members, 1)))}
    full = member_tensors(model, members, 1e-3, 0)

    def one_by_one():
        for i in range(members):
            saved = materialise(model, full, i)
            gen(ids)
            restore(model, saved)

    res["sequential_full"] = timed(one_by_one)
    for name, w in (("batched_full", full), (f"batched_lowrank_r{rank}", member_tensors(model, members, 1e-3, rank))):
        with member_modules(model, Members(w, members)):
            gen(ids[:2].repeat(members, 1))  # warm-up of the shapes
            res[name] = timed(lambda: gen(ids.repeat(members, 1)))
        del w
    full = None
    res["pure_again"] = timed(lambda: gen(ids.repeat(members, 1)))
    limit = tokens / min(res["pure"], res["pure_again"])
    return {"members": members, "prompts": prompts, "new_tokens": new_tokens, "tokens_per_path": tokens,
            "seconds": {k: round(v, 3) for k, v in res.items()},
            "tokens_per_s": {k: round(tokens / v, 1) for k, v in res.items()},
            "ratio_to_pure": {k: round(tokens / v / limit, 3) for k, v in res.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--device", default="cuda", help="cuda (cpu only to try the script at small sizes)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    import transformers

    out = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
           "equality_fp32": equality(dev)}
    print(json.dumps(out), flush=True)
    out["throughput_bf16"] = throughput(dev, args.members, args.prompts, args.new_tokens, args.rank)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
