#!/usr/bin/env python3
"""Every LLaMA variant's export loads in Hugging Face `transformers` and gives the engine's loss.

For each variant (and a few option combinations): train a short llama-tiny run on the
built-in tinyshakespeare (so gates and zero-initialised parts have moved), `transponder
export` it, load the directory with `AutoModelForCausalLM.from_pretrained` (pre-ln as plain
`LlamaForCausalLM`, the others with `trust_remote_code=True`), and compute the validation
loss on exactly the windows `transponder eval` reads (consecutive windows of seq_len + 1
tokens from the start of val.bin, batch by batch). Also generates 16 greedy tokens after
"ROMEO:" with `model.generate` and with `transponder sample --temperature 0` (KV cache).
Prints both losses, their difference and whether the generations match, per row, and exits
non-zero when a load reports missing or unexpected weights, a difference exceeds
--tolerance (1e-4) or the generations differ.

Run by hand, not in CI (it needs torch + transformers, CPU is enough):

    cargo build --release -p trainer
    /path/to/venv/bin/python bench/hf_parity.py [--variants transponder,ccl] [--steps 30]
"""

import argparse
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "transponder")
VARIANTS = [
    "pre-ln", "path-scalar", "path-channel", "layer-scalar", "layer-channel", "transponder",
    "non-contextual", "fixed-alpha", "comt", "per-token", "token-scale", "ccl", "post-ln",
    "deepnorm", "mix-ln", "ln-scaling", "rezero", "laurel-rw", "laurel-lr", "laurel-pa",
    "sdpa-gate", "all-gate", "dyt",
]
# (row name, variant, extra `transponder train` flags)
COMBINATIONS = [
    ("transponder --post-ln", "transponder", ["--post-ln"]),
    ("comt --coverage attn --phi silu", "comt", ["--coverage", "attn", "--phi", "silu"]),
    ("ccl --ccl-mode causal-mean", "ccl", ["--ccl-mode", "causal-mean"]),
    ("ccl --ccl-ablation no-out-gate", "ccl", ["--ccl-ablation", "no-out-gate"]),
    ("layer-channel --rank 4 --coverage no-up-gate", "layer-channel", ["--rank", "4", "--coverage", "no-up-gate"]),
]


def run(args):
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def read_tokens(path):
    """An llm.c token file: 256 int32 header (magic, version, count), then the tokens."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    dtype = np.uint16 if header[1] == 1 else np.uint32
    return np.fromfile(path, dtype=dtype, offset=256 * 4)[: header[2]].astype(np.int64)


def hf_loss(model, tokens, batch_size, seq_len, batches):
    """The mean over batches of each batch's mean next-token loss, windows as `eval` reads them."""
    windows_per_pass = (len(tokens) - 1) // seq_len
    batches = max(1, min(batches, windows_per_pass // batch_size))
    total, position = 0.0, 0
    with torch.no_grad():
        for _ in range(batches):
            rows = []
            for _ in range(batch_size):
                if position + seq_len + 1 > len(tokens):
                    position = 0
                rows.append(tokens[position : position + seq_len + 1])
                position += seq_len
            window = torch.tensor(np.stack(rows))
            logits = model(input_ids=window[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            total += loss.item()
    return total / batches


PROMPT = "ROMEO:"
GENERATED = 16


def hf_greedy(model):
    """`PROMPT` and 16 greedy tokens from `transformers`' generate, as text (byte tokenizer)."""
    ids = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GENERATED, do_sample=False)
    return bytes(out[0].tolist()).decode("utf-8", "replace")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", help="comma-separated names (default: every variant and combination)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "hf-parity"))
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [(v, v, []) for v in VARIANTS] + COMBINATIONS
    if args.variants:
        wanted = args.variants.split(",")
        rows = [r for r in rows if r[0] in wanted]
    data = os.path.join(args.work_dir, "data")
    if not os.path.exists(os.path.join(data, "val.bin")):
        run([BIN, "prepare", os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--out", data])
    tokens = read_tokens(os.path.join(data, "val.bin"))

    print(f"{'variant':<46} {'kind':<24} {'transponder eval':>16} {'transformers':>13} {'|diff|':>9}  generate")
    failures = []
    for name, variant, extra in rows:
        out = os.path.join(args.work_dir, re.sub(r"[^a-z0-9]+", "-", name).strip("-"))
        run([BIN, "train", "--variant", variant, *extra, "--steps", str(args.steps), "--batch-size", "8",
             "--seq-len", str(args.seq_len), "--warmup", "5", "--eval-every", "0", "--log-every", "1000",
             "--train-data", os.path.join(data, "train.bin"), "--val-data", os.path.join(data, "val.bin"),
             "--out-dir", out])
        checkpoint = os.path.join(out, "checkpoint.safetensors")
        evaluated = run([BIN, "eval", checkpoint, os.path.join(data, "val.bin"),
                         "--batch-size", str(args.batch_size), "--batches", str(args.batches)])
        ours = float(re.search(r"val loss ([0-9.]+)", evaluated).group(1))
        export = os.path.join(out, "hf")
        run([BIN, "export", checkpoint, export])
        model, info = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, output_loading_info=True)
        model.eval()
        if any(p.dtype != torch.float32 for p in model.parameters()):
            failures.append(f"{name}: loaded with parameters other than float32")
        bad_keys = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        theirs = hf_loss(model, tokens, args.batch_size, args.seq_len, args.batches)
        diff = abs(ours - theirs)
        kind = type(model).__name__
        sampled = run([BIN, "sample", checkpoint, "--prompt", PROMPT, "--max-new-tokens", str(GENERATED),
                       "--temperature", "0"])
        # `sample` prints the text and a newline; the text itself may end in generated newlines.
        same = sampled.removesuffix("\n") == hf_greedy(model)
        print(f"{name:<46} {kind:<24} {ours:>16.6f} {theirs:>13.6f} {diff:>9.1e}  {'same' if same else 'DIFFERS'}",
              flush=True)
        if not same:
            failures.append(f"{name}: greedy generation differs")
        if bad_keys:
            failures.append(f"{name}: {bad_keys}")
        if diff > args.tolerance:
            failures.append(f"{name}: |{ours} - {theirs}| = {diff:.2e}")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print(f"all {len(rows)} rows agree within {args.tolerance:g}")


if __name__ == "__main__":
    main()
