"""Train kvlab-bytes-py once: a small Qwen2-architecture model over bytes (vocabulary 256: a token is a byte of
UTF-8 text), on train.txt.gz beside this script, judged on heldout.txt.gz (make_corpus.py made both). Weights that
are not random, so that what an FP8 wire does to greedy decoding and perplexity says something (issue 29).

`python train.py OUT [--steps N] [--device cuda]` writes OUT/config.json and OUT/model.safetensors (bfloat16,
loadable by transformers' from_pretrained and so by kvlab.models.build(OUT, weights=OUT)), OUT/loss.csv (the
loss curve: training loss every 10 steps, held-out loss every 250) and OUT/run.json (what ran, where, how long,
the corpus's sha256). OUT must not exist. Seeded: the same device and versions give the same windows and initial
weights (GPU kernels need not be bitwise repeatable, so the committed weights are the result, not this script).

Recipe: 4 layers, hidden 256, 4 query heads and 2 KV heads of 64 (grouped-query attention, two query heads a KV head),
MLP 512, tied embeddings; AdamW (lr 3e-3, betas 0.9 / 0.95, weight decay 0.1), 100 warm-up steps then cosine to
10 %, batches of 32 random windows of 512 bytes, bfloat16 autocast on a GPU, gradient norm clipped at 1."""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=256, hidden_size=256,
              intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
              hidden_act="silu", initializer_range=0.02, use_sliding_window=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
SEQ, BATCH, LR, WARMUP = 512, 32, 3e-3, 100
EVAL_EVERY, EVAL_WINDOWS = 250, 64


def load(name: str) -> tuple[np.ndarray, str]:
    data = gzip.decompress((HERE / name).read_bytes())
    return np.frombuffer(data, dtype=np.uint8), hashlib.sha256(data).hexdigest()


def windows(data: np.ndarray, starts: np.ndarray, device) -> torch.Tensor:
    idx = starts[:, None] + np.arange(SEQ + 1)[None, :]
    return torch.from_numpy(data[idx].astype(np.int64)).to(device)


def loss_of(model, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=8.0, help="stop early after this long (recorded)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        parser.error(f"out {str(out)!r} already exists: give a new folder (a trained model is never overwritten)")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    from transformers import AutoConfig, AutoModelForCausalLM

    train, train_sha = load("train.txt.gz")
    held, held_sha = load("heldout.txt.gz")
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    cfg = AutoConfig.for_model(**{k: v for k, v in CONFIG.items() if k != "model_type"}, model_type="qwen2")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev).train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    held_starts = np.linspace(0, held.size - SEQ - 2, EVAL_WINDOWS).astype(np.int64)
    autocast = dev.type == "cuda"
    planned = args.steps
    rows, t0 = [], time.perf_counter()

    def held_loss() -> float:
        model.eval()
        with torch.no_grad():
            value = float(loss_of(model, windows(held, held_starts, dev), autocast))
        model.train()
        return value

    for step in range(args.steps + 1):
        if step % EVAL_EVERY == 0 or step == args.steps:
            rows.append({"step": step, "split": "heldout", "loss": held_loss(), "seconds": time.perf_counter() - t0})
            print(f"step {step:5d}  held-out loss {rows[-1]['loss']:.4f} nats/byte  {rows[-1]['seconds']:.0f} s",
                  flush=True)
        if step == args.steps:
            break
        batch = windows(train, rng.integers(0, train.size - SEQ - 1, size=BATCH), dev)
        loss = loss_of(model, batch, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0:
            rows.append({"step": step, "split": "train", "loss": float(loss.detach()), "seconds": time.perf_counter() - t0})
        if time.perf_counter() - t0 > 60 * args.max_minutes:
            print(f"stopped at step {step + 1} of {args.steps}: --max-minutes {args.max_minutes} reached", flush=True)
            args.steps = step + 1
            rows.append({"step": args.steps, "split": "heldout", "loss": held_loss(), "seconds": time.perf_counter() - t0})
            break
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True)
    model.to(torch.bfloat16).eval().save_pretrained(out, safe_serialization=True)
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "split", "loss", "seconds"])
        w.writeheader()
        w.writerows(rows)
    final = [r for r in rows if r["split"] == "heldout"][-1]["loss"]
    record = {"model": "kvlab-bytes-py", "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
              "python": sys.version.split()[0], "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "steps": args.steps, "planned_steps": planned, "seed": args.seed,
              "batch": BATCH, "seq": SEQ, "lr": LR, "warmup": WARMUP, "params": params, "train_seconds": seconds,
              "heldout_loss_nats_per_byte": final, "heldout_bits_per_byte": final / math.log(2),
              "train_sha256": train_sha, "heldout_sha256": held_sha, "config": CONFIG}
    (out / "run.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"{params:,} parameters, {args.steps} steps in {seconds:.0f} s, held-out {final:.4f} nats/byte "
          f"({final / math.log(2):.3f} bits/byte); wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
