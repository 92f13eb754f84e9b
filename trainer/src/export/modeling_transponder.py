"""Transponder engine LLaMA variants for Hugging Face `transformers` (PyTorch).

Written into an export directory by `transponder export` together with `config.json` (whose
`auto_map` points here) and `model.safetensors`, so that

    AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)

loads a checkpoint of any variant the engine trains. The math follows the engine's SPEC:

  decoder (§6)   embedding, N blocks, final RMSNorm (DyT for `dyt`), untied LM head, no biases;
                 attention with RoPE (rotate-half, angles in f64) and causal SDPA; SwiGLU FFN.
  §1 modulator   G(x) = 2*sigmoid(alpha * (B phi(A x + a) + b)); scalar (m = 1) or channel
                 (m = d_out); `layer-*` on each covered projection's output, reading its input;
                 `path-*` on the attention / FFN output, reading the sublayer's input;
                 `layer-channel-scalar` (= transponder) multiplies a channel and a scalar gate;
                 `non-contextual` G = 2*sigmoid(alpha * beta1 * beta2); `fixed-alpha` alpha = 1.
  §2 CoMT        g(x) = sigmoid(w2 phi(W1 x + c1) + c2) on each covered projection.
  §3 CCL         y = ((LayerNorm(x W_basis) * g_b) W_mix + bias) * g_o, gates sigmoid(Linear(c_t)),
                 c_t = SiLU(W_ctx h_t [+ W_mean mean_{s<=t} h_s]) per block, on the FFN's layers.
  §4 per-token   x + U (M[token] (D x)) between the sublayers; token-scale: FFN output * E[token].
  §5 baselines   residual rules (post-ln, deepnorm, mix-ln, ln-scaling, rezero, laurel-rw/lr/pa),
                 dense sigmoid gates (sdpa-gate, all-gate) and DyT norms.

Parameter names are the engine's, which extend `LlamaForCausalLM`'s
(`model.layers.{i}.self_attn.q_proj.weight`, `...q_proj.modulator_channel.A`, ...). The
engine's own config travels as `config.transponder`. Positions are absolute from 0 (no
padding support: pass unpadded sequences of equal length, as the engine does).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

try:
    from transformers import PretrainedConfig
except ImportError:  # transformers >= 5 spells it PreTrainedConfig
    from transformers import PreTrainedConfig as PretrainedConfig

try:
    from transformers.generation import GenerationMixin
except ImportError:
    GenerationMixin = object

# Every variant this file implements (the engine refuses to export any other).
VARIANTS = (
    "pre-ln", "path-scalar", "path-channel", "layer-scalar", "layer-channel",
    "layer-channel-scalar", "non-contextual", "fixed-alpha", "comt", "per-token",
    "token-scale", "ccl", "post-ln", "deepnorm", "mix-ln", "ln-scaling", "rezero",
    "laurel-rw", "laurel-lr", "laurel-pa", "sdpa-gate", "all-gate", "dyt",
)
PROJECTION_MODULATORS = (
    "layer-scalar", "layer-channel", "layer-channel-scalar", "non-contextual", "fixed-alpha", "comt",
)
OWN_RESIDUAL_RULE = ("deepnorm", "mix-ln", "ln-scaling", "rezero", "laurel-rw", "laurel-lr", "laurel-pa", "dyt")
PHI = {"sigmoid": torch.sigmoid, "silu": F.silu, "relu": F.relu}
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def covers(coverage, projection):
    """Whether `coverage` (SPEC §1 ablation names) puts a modulator on `projection`."""
    attn = projection in ATTENTION_PROJECTIONS
    return {
        "all": True,
        "attn": attn,
        "mlp": not attn,
        "only-first": projection not in ("o_proj", "down_proj"),
        "only-last": projection in ("o_proj", "down_proj"),
        "only-qk": projection in ("q_proj", "k_proj"),
        "no-up-gate": projection not in ("gate_proj", "up_proj"),
    }[coverage]


class TransponderConfig(PretrainedConfig):
    """LLaMA sizes under their `LlamaConfig` names, plus the engine's config in `transponder`."""

    model_type = "transponder"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        transponder=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.transponder = dict(transponder or {})
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class Options:
    """The engine's variant knobs, read from `config.transponder` with the engine's defaults."""

    def __init__(self, config):
        t = config.transponder
        self.variant = t.get("variant", "pre-ln")
        if self.variant == "transponder":
            self.variant = "layer-channel-scalar"
        if self.variant not in VARIANTS:
            raise ValueError(f"variant {self.variant!r} is not implemented here; known: {', '.join(VARIANTS)}")
        self.post_ln = bool(t.get("post_ln", False))
        self.rank = int(t.get("rank", 8))
        self.phi = PHI[t.get("phi", "sigmoid")]
        self.coverage = t.get("coverage", "all")
        self.learnable_alpha = not (t.get("fixed_alpha", False) or self.variant == "fixed-alpha")
        self.comt_hidden = int(t.get("comt_hidden", 2))
        self.laurel_rank = int(t.get("laurel_rank", 16))
        per_token_rank = int(t.get("per_token_rank", 0))
        self.per_token_rank = per_token_rank or max(1, round(math.sqrt(config.hidden_size)))
        self.d_basis = int(t.get("d_basis", 64))
        self.d_ctx = int(t.get("d_ctx", 64))
        self.ccl_mode = t.get("ccl_mode", "token")
        self.ccl_ablation = t.get("ccl_ablation", "none")


def linear(d_in, d_out, bias=False):
    return nn.Linear(d_in, d_out, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DyT(nn.Module):
    """gamma * tanh(alpha x) + beta in place of a norm (the `dyt` baseline)."""

    def __init__(self, dim):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), 0.5))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return torch.tanh(x * self.alpha) * self.weight + self.bias


def make_norm(config, opts):
    return DyT(config.hidden_size) if opts.variant == "dyt" else RMSNorm(config.hidden_size, config.rms_norm_eps)


class Modulator(nn.Module):
    """SPEC §1: G(x) = 2 sigmoid(alpha (B phi(A x + a) + b)), m = 1 (scalar) or d_out (channel)."""

    def __init__(self, d_in, m, opts):
        super().__init__()
        self.A = nn.Parameter(torch.zeros(opts.rank, d_in))
        self.a = nn.Parameter(torch.zeros(opts.rank))
        self.B = nn.Parameter(torch.zeros(m, opts.rank))
        self.b = nn.Parameter(torch.zeros(m))
        self.alpha = nn.Parameter(torch.ones(1)) if opts.learnable_alpha else 1.0
        self.phi = opts.phi

    def forward(self, x):
        logits = self.phi(x @ self.A.T + self.a) @ self.B.T + self.b
        return 2.0 * torch.sigmoid(logits * self.alpha)


class NonContextualGate(nn.Module):
    """SPEC §1 `non-contextual`: 2 sigmoid(alpha beta1 beta2), the same for every token."""

    def __init__(self, d_out, opts):
        super().__init__()
        self.beta1 = nn.Parameter(torch.ones(1))
        self.beta2 = nn.Parameter(torch.zeros(d_out))
        self.alpha = nn.Parameter(torch.ones(1)) if opts.learnable_alpha else 1.0

    def forward(self, x):
        return 2.0 * torch.sigmoid(self.beta2 * self.beta1 * self.alpha)


class ComtModulator(nn.Module):
    """SPEC §2: g(x) = sigmoid(w2 phi(W1 x + c1) + c2), one scalar per token."""

    def __init__(self, d_in, opts):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(opts.comt_hidden, d_in))
        self.c1 = nn.Parameter(torch.zeros(opts.comt_hidden))
        self.w2 = nn.Parameter(torch.zeros(1, opts.comt_hidden))
        self.c2 = nn.Parameter(torch.zeros(1))
        self.phi = opts.phi

    def forward(self, x):
        return torch.sigmoid(self.phi(x @ self.w1.T + self.c1) @ self.w2.T + self.c2)


class DenseGate(nn.Module):
    """SPEC §5 SDPA-Gate / ALL-Gate: sigmoid(x W_g^T), W_g full d_out x d_in."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in))

    def forward(self, x):
        return torch.sigmoid(x @ self.weight.T)


def add_gates(owner, opts, name, d_in, d_out):
    """Registers the gates `name` (a projection d_in -> d_out) carries; returns their attribute names."""
    v, covered = opts.variant, covers(opts.coverage, name)
    gates = []
    if v == "layer-scalar" and covered:
        gates = [("modulator_scalar", Modulator(d_in, 1, opts))]
    elif v == "layer-channel" and covered:
        gates = [("modulator_channel", Modulator(d_in, d_out, opts))]
    elif v in ("layer-channel-scalar", "fixed-alpha") and covered:
        gates = [("modulator_channel", Modulator(d_in, d_out, opts)), ("modulator_scalar", Modulator(d_in, 1, opts))]
    elif v == "non-contextual" and covered:
        gates = [("modulator", NonContextualGate(d_out, opts))]
    elif v == "comt" and covered:
        gates = [("modulator", ComtModulator(d_in, opts))]
    elif v == "all-gate" or (v == "sdpa-gate" and name in ("q_proj", "k_proj", "v_proj")):
        gates = [("output_gate", DenseGate(d_in, d_out))]
    for attribute, gate in gates:
        owner.add_module(attribute, gate)
    return [attribute for attribute, _ in gates]


class Projection(nn.Module):
    """A bias-free linear layer whose output is multiplied by its gates, each reading its input."""

    def __init__(self, d_in, d_out, opts, name):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in))
        self.gates = add_gates(self, opts, name, d_in, d_out)

    def forward(self, x):
        y = x @ self.weight.T
        if self.gates == ["modulator_channel", "modulator_scalar"]:
            return y * (self.modulator_channel(x) * self.modulator_scalar(x))
        for attribute in self.gates:
            y = y * getattr(self, attribute)(x)
        return y


def add_path_gate(owner, opts, projection, d):
    """`path-*` variants gate the whole sublayer output when `projection` (o or down) is covered."""
    if opts.variant in ("path-scalar", "path-channel") and covers(opts.coverage, projection):
        scalar = opts.variant == "path-scalar"
        attribute = "modulator_scalar" if scalar else "modulator_channel"
        owner.add_module(attribute, Modulator(d, 1 if scalar else d, opts))
        return [attribute]
    return []


def rope(x, theta):
    """Rotate-half RoPE of x: [B, T, H, D] at positions 0..T-1, angles computed in float64."""
    t, d = x.shape[1], x.shape[3]
    inv_freq = theta ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype).to(x.device)[None, :, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype).to(x.device)[None, :, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config, opts):
        super().__init__()
        d = config.hidden_size
        self.heads, self.theta = config.num_attention_heads, config.rope_theta
        self.q_proj = Projection(d, d, opts, "q_proj")
        self.k_proj = Projection(d, d, opts, "k_proj")
        self.v_proj = Projection(d, d, opts, "v_proj")
        self.o_proj = Projection(d, d, opts, "o_proj")
        self.sdpa_gate = DenseGate(d, d) if opts.variant == "sdpa-gate" else None
        self.path_gates = add_path_gate(self, opts, "o_proj", d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q = rope(self.q_proj(x).view(b, t, h, d // h), self.theta)
        k = rope(self.k_proj(x).view(b, t, h, d // h), self.theta)
        v = self.v_proj(x).view(b, t, h, d // h)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = o.transpose(1, 2).reshape(b, t, d)
        if self.sdpa_gate is not None:
            o = o * self.sdpa_gate(x)
        y = self.o_proj(o)
        for attribute in self.path_gates:
            y = y * getattr(self, attribute)(x)
        return y


class SwiGLU(nn.Module):
    def __init__(self, config, opts):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = Projection(d, hidden, opts, "gate_proj")
        self.up_proj = Projection(d, hidden, opts, "up_proj")
        self.down_proj = Projection(hidden, d, opts, "down_proj")
        self.path_gates = add_path_gate(self, opts, "down_proj", d)

    def forward(self, x):
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        for attribute in self.path_gates:
            y = y * getattr(self, attribute)(x)
        return y


class ContextManager(nn.Module):
    """SPEC §3: c_t = SiLU(W_ctx h_t [+ W_mean mean_{s<=t} h_s])."""

    def __init__(self, d, opts):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(opts.d_ctx, d))
        self.mean_weight = nn.Parameter(torch.zeros(opts.d_ctx, d)) if opts.ccl_mode == "causal-mean" else None

    def forward(self, h):
        z = h @ self.weight.T
        if self.mean_weight is not None:
            counts = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device)[None, :, None]
            z = z + (h.cumsum(1) / counts) @ self.mean_weight.T
        return F.silu(z)


class ContextConditionedLinear(nn.Module):
    """SPEC §3: y = ((LayerNorm(x W_basis) * g_b) W_mix + bias) * g_o."""

    def __init__(self, d_in, d_out, opts):
        super().__init__()
        k = opts.d_basis
        self.basis = linear(d_in, k)
        self.norm = nn.LayerNorm(k, eps=1e-5)
        self.mix = linear(k, d_out)
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.gate_basis = linear(opts.d_ctx, k, bias=True) if opts.ccl_ablation in ("none", "no-out-gate") else None
        self.gate_out = linear(opts.d_ctx, d_out, bias=True) if opts.ccl_ablation in ("none", "no-basis-gate") else None

    def forward(self, x, c):
        h = self.norm(self.basis(x))
        if self.gate_basis is not None:
            h = h * torch.sigmoid(self.gate_basis(c))
        y = self.mix(h) + self.bias
        if self.gate_out is not None:
            y = y * torch.sigmoid(self.gate_out(c))
        return y


class CclFfn(nn.Module):
    def __init__(self, config, opts):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.context = ContextManager(d, opts) if opts.ccl_ablation != "static" else None
        self.gate_proj = ContextConditionedLinear(d, hidden, opts)
        self.up_proj = ContextConditionedLinear(d, hidden, opts)
        self.down_proj = ContextConditionedLinear(hidden, d, opts)

    def forward(self, h):
        c = self.context(h) if self.context is not None else None
        return self.down_proj(F.silu(self.gate_proj(h, c)) * self.up_proj(h, c), c)


class PerTokenTransform(nn.Module):
    """SPEC §4: U (M[token] (D x))."""

    def __init__(self, config, opts):
        super().__init__()
        d, r = config.hidden_size, opts.per_token_rank
        self.down = linear(d, r)
        self.table = nn.Parameter(torch.zeros(config.vocab_size, r, r))
        self.up = linear(r, d)

    def forward(self, x, ids):
        mixed = (self.table[ids] * self.down(x).unsqueeze(-2)).sum(-1)
        return self.up(mixed)


class TokenScale(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.vocab_size, config.hidden_size))

    def forward(self, y, ids):
        return y * self.weight[ids]


def residual_rule(config, opts, layer):
    """(rule, parameter) of block `layer` (0-based), as the engine's `residual_rule`."""
    v, n, l = opts.variant, config.num_hidden_layers, layer + 1
    plain = ("post", 1.0) if opts.post_ln else ("pre", 1.0)
    if v == "post-ln":
        return ("post", 1.0)
    if v == "deepnorm":
        return ("post", (2.0 * n) ** 0.25)
    if v == "mix-ln":
        return ("post", 1.0) if l <= n // 4 else ("pre", 1.0)
    if v == "dyt":
        return ("pre", 1.0)
    if v == "ln-scaling":
        return ("pre", 1.0 / math.sqrt(l))
    if v == "rezero":
        return ("rezero", None)
    if v == "laurel-rw":
        return ("laurel-rw", None)
    if v == "laurel-lr":
        return ("laurel-lr", opts.laurel_rank)
    if v == "laurel-pa":
        return ("laurel-pa", layer)
    return plain


class Laurel(nn.Module):
    """LAuReL-RW's alpha, beta or LAuReL-LR's A, B of one sublayer."""

    def __init__(self, kind, d, rank):
        super().__init__()
        if kind == "laurel-rw":
            self.alpha = nn.Parameter(torch.ones(1))
            self.beta = nn.Parameter(torch.ones(1))
        else:
            self.A = nn.Parameter(torch.zeros(rank, d))
            self.B = nn.Parameter(torch.zeros(d, rank))


class DecoderBlock(nn.Module):
    def __init__(self, config, opts, layer):
        super().__init__()
        d = config.hidden_size
        self.kind, self.param = residual_rule(config, opts, layer)
        self.self_attn = Attention(config, opts)
        self.mlp = CclFfn(config, opts) if opts.variant == "ccl" else SwiGLU(config, opts)
        if self.kind != "rezero":
            self.input_layernorm = make_norm(config, opts)
            self.post_attention_layernorm = make_norm(config, opts)
        else:
            self.resweight = nn.Parameter(torch.zeros(1))
        if self.kind in ("laurel-rw", "laurel-lr"):
            self.attn_laurel = Laurel(self.kind, d, self.param)
            self.mlp_laurel = Laurel(self.kind, d, self.param)
        if self.kind == "laurel-pa" and self.param > 0:
            self.laurel_pa = nn.Module()
            self.laurel_pa.gamma = nn.Parameter(torch.zeros(self.param))
        self.per_token = PerTokenTransform(config, opts) if opts.variant == "per-token" else None
        self.token_scale = TokenScale(config) if opts.variant == "token-scale" else None

    def sublayer(self, x, norm, laurel, f):
        kind, param = self.kind, self.param
        if kind == "pre" and param != 1.0:
            return x + f(norm(x) * param)
        if kind == "post" and param != 1.0:
            return norm(x * param + f(x))
        if kind == "post":
            return norm(x + f(x))
        if kind in ("pre", "laurel-pa"):
            return x + f(norm(x))
        if kind == "rezero":
            return x + f(x) * self.resweight
        if kind == "laurel-rw":
            return f(norm(x)) * laurel.alpha + x * laurel.beta
        if kind == "laurel-lr":
            return f(norm(x)) + x + (x @ laurel.A.T) @ laurel.B.T
        raise ValueError(f"unknown residual rule {kind}")

    def forward(self, x, ids, earlier):
        rezero = self.kind == "rezero"
        attn_norm = None if rezero else self.input_layernorm
        mlp_norm = None if rezero else self.post_attention_layernorm

        def ffn(h):
            y = self.mlp(h)
            return self.token_scale(y, ids) if self.token_scale is not None else y

        x = self.sublayer(x, attn_norm, getattr(self, "attn_laurel", None), self.self_attn)
        if self.per_token is not None:
            x = x + self.per_token(x, ids)
        x = self.sublayer(x, mlp_norm, getattr(self, "mlp_laurel", None), ffn)
        if self.kind == "laurel-pa" and self.param > 0:
            for j, activation in enumerate(earlier):
                x = x + activation * self.laurel_pa.gamma[j]
        return x


class TransponderModel(nn.Module):
    def __init__(self, config, opts):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, opts, l) for l in range(config.num_hidden_layers))
        self.norm = make_norm(config, opts)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        activations = [x]
        for l, block in enumerate(self.layers):
            x = block(x, ids, activations[:l])
            activations.append(x)
        return self.norm(x)


class TransponderPreTrainedModel(PreTrainedModel):
    config_class = TransponderConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        # Every parameter comes from the checkpoint; nothing to initialise.
        pass


class TransponderForCausalLM(TransponderPreTrainedModel, GenerationMixin):
    """Logits [B, T, V] for input_ids [B, T]; with `labels`, the mean next-token cross-entropy
    (labels shifted inside, as `LlamaForCausalLM`). No KV cache: each call reads the whole sequence."""

    def __init__(self, config):
        super().__init__(config)
        self.model = TransponderModel(config, Options(config))
        self.lm_head = linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}
