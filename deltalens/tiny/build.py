"""Build the bundled tiny base model: a char-level Llama SFT'd on the `arith` task.

    python -m deltalens.tiny.build --out deltalens/tiny/model            # ~20 min on 2 CPU cores
    python -m deltalens.tiny.build --out tiny-l --hidden 256 --intermediate 704 --device cuda
                                                  # a 4x larger sibling (claim 6: two model sizes)

Deterministic: fixed seeds, fixed data stream, single-threaded-safe ops, so the same torch version on
the same CPU rebuilds the same weights (BLAS differences across machines can change the last bits).

Why it looks like this
- A real transformers `LlamaForCausalLM` with untied embeddings (embed_tokens and lm_head are separate
  tensors), RMSNorm weights, q/k/v/o projections with grouped KV heads, and a gated MLP: every parameter
  group that `deltalens diff` reports exists here.
- Character-level tokenizer (printable ASCII + newline + <pad>/<eos>/<unk>) built with `tokenizers`, saved
  as tokenizer.json so `AutoTokenizer.from_pretrained` loads it. Arithmetic is digit work, so characters
  are the natural unit, and 98 tokens keep the embedding small.
- SFT on a 60/30/10 mix of three solution orders (see `deltalens.tasks.ARITH_STRATEGIES`), loss on the
  completion only. Training stops early on purpose (`--steps`): the base model must leave room for RL
  (Pass@1 around 0.15-0.5 with a much higher Pass@32), not solve the task.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from deltalens.tasks import ArithTask
from deltalens.tiny import MODEL_DIR

SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]  # newline + printable ASCII


def build_tokenizer():
    """A char-level fast tokenizer: one token per character, <eos> appended by us, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", model_max_length=512, clean_up_tokenization_spaces=False,
    )


def build_config(vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 352):
    """Llama config; head_dim = hidden / heads (32 for the bundled model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, rope_theta=10000.0,
    )


def encode_batch(tok, problems, device="cpu"):
    """Right-padded (prompt + solution + <eos>) ids and labels masked to the completion. Shapes (B, T)."""
    seqs, labels = [], []
    for p in problems:
        a = tok(p.prompt, add_special_tokens=False)["input_ids"]
        b = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(a + b)
        labels.append([-100] * len(a) + b)
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), T), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        att[i, : len(s)] = 1
    return ids.to(device), lab.to(device), att.to(device)


def train(out: Path, steps: int, batch: int, lr: float, seed: int, horizon: int, snapshot_every: int = 0,
          hidden: int = 128, layers: int = 4, intermediate: int = 352, heads: int = 4, kv_heads: int = 2,
          device: str = "cpu", log=print) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    tok = build_tokenizer()
    config = build_config(len(tok), hidden=hidden, layers=layers, intermediate=intermediate, heads=heads,
                          kv_heads=kv_heads)
    model = LlamaForCausalLM(config).to(device)   # initialised on the CPU: same init on every device
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny model: {n_params:,} parameters, vocab {len(tok)}")
    task = ArithTask(seed=0)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    # Cosine schedule over `horizon` steps, stopped at `steps` <= horizon: a snapshot at step s of a
    # long run equals a run with --steps s, so the stopping point can be chosen from one calibration run.
    warmup = max(1, horizon // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, horizon) / horizon)))
    model.train()
    t0 = time.time()
    for step in range(1, steps + 1):
        ids, lab, att = encode_batch(tok, task.train(batch, rng), device)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:6.1f}s")
        if snapshot_every and step % snapshot_every == 0 and step < steps:
            _save(model, tok, out.parent / f"{out.name}-step{step}", {"steps": step})
    info = {"steps": steps, "horizon": horizon, "batch": batch, "lr": lr, "seed": seed, "n_params": n_params,
            "final_loss": loss.item(), "seconds": round(time.time() - t0, 1), "torch": torch.__version__,
            "device": device, "hidden": hidden, "layers": layers, "intermediate": intermediate}
    _save(model, tok, out, info)
    return info


def _save(model, tok, out: Path, info: dict):
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # saved from the CPU, any device
    model.save_pretrained(out, state_dict=sd, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    model.train()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=MODEL_DIR, help="output directory")
    ap.add_argument("--steps", type=int, default=550, help="SFT steps (stops early on purpose)")
    ap.add_argument("--horizon", type=int, default=1200, help="cosine LR schedule length (>= steps)")
    ap.add_argument("--batch", type=int, default=128, help="problems per step")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine decay)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-every", type=int, default=0, help="also save snapshots every N steps")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (head_dim = hidden / heads)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--intermediate", type=int, default=352, help="MLP intermediate size")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (same init; BLAS differs, so not bit-equal)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.steps > args.horizon:
        ap.error("--steps must be <= --horizon")
    info = train(args.out, args.steps, args.batch, args.lr, args.seed, args.horizon, args.snapshot_every,
                 hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, heads=args.heads,
                 kv_heads=args.kv_heads, device=args.device)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
