"""PyTorch twin of `train-bench`: the same LLaMA presets, variants, optimizer and timing.

SPEC §6: token embedding, N blocks of RMSNorm -> causal multi-head attention with RoPE
(theta 10000, Hugging Face rotate-half) -> residual, RMSNorm -> SwiGLU -> residual, final
RMSNorm, untied LM head, no biases. Init as the engine: embeddings and base weights
N(0, 0.02^2), norm gains 1, eps 1e-6.

Variants:
  pre-ln       the baseline above.
  transponder  SPEC §1 layer-channel-scalar on every projection q, k, v, o, gate, up, down:
               y = (x W^T) * s~_ac(B_c phi(A_c x + a_c) + b_c) * s~_as(B_s phi(A_s x + a_s) + b_s),
               r = 8, phi = sigmoid, s~_a(z) = 2 sigmoid(a z); A, B Kaiming-uniform (nn.Linear's
               default), a, b zero, alpha 1 (learnable). Written the way a PyTorch user would
               (eager, one module per modulator).

Protocol (identical to train-bench): AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, decay 0.01 on
matrices only, as the engine), --warmup untimed steps, then --steps timed steps of
forward -> loss -> backward -> step -> zero_grad(set_to_none); tokens/s = B*T / median step.
--forward-only times forward + loss under torch.no_grad(). Peak memory is VmHWM.
The last line printed is one JSON object.

    bench/.venv/bin/python bench/torch_llama.py --model llama-tiny --variant pre-ln \
        --batch 16 --seq 256 --steps 10 [--forward-only] [--threads 2]
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# (d_model, ffn_hidden, n_layers, n_heads), SPEC §6.
PRESETS = {
    "llama-tiny": (128, 344, 4, 4),
    "llama-small": (256, 688, 6, 8),
    "llama-60m": (512, 1376, 8, 8),
}
INIT_STD = 0.02
RANK = 8


def proc_status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Hugging Face LlamaRMSNorm.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Modulator(nn.Module):
    """G(x) = 2 sigmoid(alpha (B phi(A x + a) + b)), phi = sigmoid (SPEC §1)."""

    def __init__(self, d_in, m):
        super().__init__()
        self.A = nn.Linear(d_in, RANK)
        self.B = nn.Linear(RANK, m)
        nn.init.zeros_(self.A.bias)
        nn.init.zeros_(self.B.bias)
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return 2.0 * torch.sigmoid(self.alpha * self.B(torch.sigmoid(self.A(x))))


class Projection(nn.Module):
    """Bias-free linear layer, optionally gated by a channel x scalar modulator pair."""

    def __init__(self, d_in, d_out, gated):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in).normal_(0.0, INIT_STD))
        self.channel = Modulator(d_in, d_out) if gated else None
        self.scalar = Modulator(d_in, 1) if gated else None

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.channel is not None:
            y = y * self.channel(x) * self.scalar(x)
        return y


def rope_tables(seq, head_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, D], rotate-half layout
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Block(nn.Module):
    def __init__(self, d, ffn, heads, gated):
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Projection(d, d, gated) for _ in range(4))
        self.gate_proj = Projection(d, ffn, gated)
        self.up_proj = Projection(d, ffn, gated)
        self.down_proj = Projection(ffn, d, gated)

    def attention(self, x, cos, sin):
        b, t, d = x.shape
        hd = d // self.heads
        # [B, H, T, D] as Hugging Face LlamaAttention.
        q = self.q_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, d))

    def forward(self, x, cos, sin):
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, preset, variant, vocab, seq):
        super().__init__()
        d, ffn, layers, heads = PRESETS[preset]
        gated = variant == "transponder"
        self.embed_tokens = nn.Embedding(vocab, d)
        nn.init.normal_(self.embed_tokens.weight, 0.0, INIT_STD)
        self.layers = nn.ModuleList(Block(d, ffn, heads, gated) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.lm_head.weight, 0.0, INIT_STD)
        cos, sin = rope_tables(seq, d // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, targets):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    p.add_argument("--variant", default="pre-ln", choices=["pre-ln", "transponder"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forward-only", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rss_start = proc_status_mib("VmRSS")
    vocab = 256
    model = Llama(args.model, args.variant, vocab, args.seq)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )
    tokens = args.batch * args.seq
    gen = torch.Generator().manual_seed(args.seed + 1)

    step_s, fwd_s, bwd_s, opt_s, loss_value = [], [], [], [], float("nan")
    for i in range(args.warmup + args.steps):
        data = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
        ids, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        t0 = time.perf_counter()
        if args.forward_only:
            with torch.no_grad():
                loss_value = model(ids, targets).item()
            t1 = t2 = time.perf_counter()
        else:
            loss = model(ids, targets)
            loss_value = loss.item()
            t1 = time.perf_counter()
            loss.backward()
            del loss
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= args.warmup:
            step_s.append(t3 - t0)
            fwd_s.append(t1 - t0)
            bwd_s.append(t2 - t1)
            opt_s.append(t3 - t2)

    step = statistics.median(step_s)
    peak = proc_status_mib("VmHWM")
    print(
        json.dumps(
            {
                "engine": "pytorch",
                "torch": torch.__version__,
                "model": args.model,
                "variant": args.variant,
                "mode": "forward" if args.forward_only else "train",
                "batch": args.batch,
                "seq": args.seq,
                "threads": torch.get_num_threads(),
                "steps": args.steps,
                "parameters": sum(p.numel() for p in model.parameters()),
                "tokens_per_s": tokens / step,
                "step_ms_median": step * 1e3,
                "step_ms_min": min(step_s) * 1e3,
                "forward_ms": statistics.median(fwd_s) * 1e3,
                "backward_ms": statistics.median(bwd_s) * 1e3,
                "optimizer_ms": statistics.median(opt_s) * 1e3,
                "peak_rss_mib": peak,
                "peak_rss_over_start_mib": peak - rss_start,
                "final_loss": loss_value if math.isfinite(loss_value) else None,
            }
        )
    )


if __name__ == "__main__":
    main()
