"""Kimi Delta Attention (KDA), GLM-5.3-Flash's linear attention, with its plain-torch reference forward.

Per head, a state S [Dk, Dv] carries the past. For each token t (q, k l2-normalised, q scaled by Dk^-0.5):
    S <- diag(exp(g_t)) S                       a forget gate per key channel, g_t in (lower_bound, 0)
    S <- S + beta_t k_t (v_t - S^T k_t)^T       the delta rule: v_t replaces what S recalled for k_t
    o_t = S^T q_t
then a gated RMSNorm per head and o_proj. q, k and v first pass a short causal depthwise convolution and SiLU.
`kda_recurrent` runs the recurrence token by token (decode); `kda_chunked` the same in chunks of 64 tokens, the
tokens of a chunk through one triangular solve (prefill). The cache keeps, per layer, the state [H, Dk, Dv] in
fp32 and the convolutions' last kernel-1 inputs: fixed sizes, whatever the context length.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..util import span
from .blocks import Linear

CHUNK = 64


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla-core's form: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, state):
    """q, k [S, H, Dk] (normalised, q scaled), v [S, H, Dv], g [S, H, Dk] (log decay), beta [S, H], state
    [H, Dk, Dv]; all fp32 -> (o [S, H, Dv], the new state)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        recalled = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t][..., None] * (beta[t][:, None] * (v[t] - recalled))[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out, state


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """kda_recurrent's result, a chunk at a time. Within a chunk with cumulative gates G_i = g_1 + .. + g_i and
    the state S0 before it, the delta-rule updates u_i = beta_i (v_i - recalled_i) solve
        (I + L) u = beta (v - (k e^G) S0),    L[i, j] = beta_i sum_c k_i[c] k_j[c] e^(G_i[c] - G_j[c])  (j < i)
    and o_i = (q_i e^G_i) S0 + sum_{j<=i} (q_i . k_j e^(G_i - G_j)) u_j, S_end = e^G_end S0 + sum_j (k_j e^(G_end - G_j)) u_j^T.
    Gate differences are taken before exp (G reaches -5 x 64: e^-G alone would overflow)."""
    S = q.shape[0]
    out = torch.empty_like(v)
    for a in range(0, S, chunk):
        b = min(S, a + chunk)
        qc, kc, vc, bc = (t[a:b].transpose(0, 1) for t in (q, k, v, beta))  # [H, C, .], beta [H, C]
        G = g[a:b].transpose(0, 1).cumsum(1)  # [H, C, Dk]
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # j <= i
        below = causal.tril(-1)  # j < i
        decay = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf")).exp()
        kk = torch.einsum("hic,hjc,hijc->hij", kc, kc, decay)  # k_i . k_j e^(G_i - G_j)
        L = (bc[..., None] * kk).masked_fill(~below, 0)
        eye = torch.eye(n, device=q.device).expand_as(L)
        rhs = bc[..., None] * (vc - torch.einsum("hic,hcv->hiv", kc * G.exp(), state))
        u = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("hic,hjc,hijc->hij", qc, kc, decay)  # [H, i, j]: 0 above the diagonal
        out[a:b] = (torch.einsum("hic,hcv->hiv", qc * G.exp(), state) + qk @ u).transpose(0, 1)
        last = G[:, -1:, :]  # [H, 1, Dk]
        state = state * last.transpose(1, 2).exp() + torch.einsum("hjc,hjv->hcv", kc * (last - G).exp(), u)
    return out, state


def forget_decay(logits, A_log, dt_bias, lower_bound: float | None) -> torch.Tensor:
    """The forget gate's log decay [S, H, D] fp32 from its logits [S, H, D]: lower_bound * sigmoid(e^A (logits +
    dt_bias)) in (lower_bound, 0), or without a bound -e^A softplus(logits + dt_bias)."""
    g = logits.float() + dt_bias.float().view(logits.shape[1:])
    rate = A_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * F.softplus(g)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution and SiLU, in fp32 (the taps are kept fp32): x [S, C], weight [C, K], past
    [K-1, C] (the inputs before x) -> [S, C] in x's dtype."""
    padded = torch.cat([past.float(), x.float()]).T[None]  # [1, C, K-1+S]
    return F.silu(F.conv1d(padded, weight.float()[:, None, :], groups=x.shape[1])[0].T).to(x.dtype)


class KDAState:
    """One KDA layer's cache: the recurrent state [H, Dk, Dv] fp32 and the last kernel-1 conv inputs [K-1, 3*H*D]."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        H, D = config.linear_num_heads, config.linear_head_dim
        self.state = torch.zeros(H, D, D, dtype=torch.float32, device=device)
        self.conv = torch.zeros(config.linear_conv_kernel_dim - 1, 3 * H * D, dtype=dtype, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"state": self.state, "conv": self.conv}

    def clear(self):
        self.state.zero_()
        self.conv.zero_()


class GatedRMSNorm(nn.Module):
    """RMSNorm per head times sigmoid(gate), in fp32 (`o_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x, gate):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * gate.float().sigmoid()).to(x.dtype)


class KDA(nn.Module):
    """A linear-attention layer (`self_attn` of a `linear_attention` layer)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        H, D, hidden = config.linear_num_heads, config.linear_head_dim, config.hidden_size
        self.n_heads, self.head_dim, self.lower_bound = H, D, config.linear_lower_bound
        self.q_proj, self.k_proj, self.v_proj = (Linear(hidden, H * D) for _ in range(3))
        K = config.linear_conv_kernel_dim
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Conv1d(H * D, H * D, K, groups=H * D, bias=False)
                                                       for _ in range(3))
        self.f_a_proj = Linear(hidden, D)
        self.f_b_proj = Linear(D, H * D)
        self.dt_bias = nn.Parameter(torch.empty(H * D))
        self.A_log = nn.Parameter(torch.empty(H))
        self.b_proj = Linear(hidden, H)
        self.g_a_proj = Linear(hidden, D)
        self.g_b_proj = Linear(D, H * D)
        self.o_norm = GatedRMSNorm(D, config.rms_norm_eps)
        self.o_proj = Linear(H * D, hidden)
        self.fused_inputs = None  # the SAME_INPUT projections at once, where their operator can (set by the loader)

    SAME_INPUT = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")  # the projections that read x

    def input_projections(self, x) -> list[torch.Tensor]:
        """The SAME_INPUT projections of x, in that order."""
        if self.fused_inputs is not None:
            return self.fused_inputs(x)
        return [getattr(self, name)(x) for name in self.SAME_INPUT]

    def conv_weight(self) -> torch.Tensor:
        """The three convolutions' taps as one [3*H*D, K] (q, k, v channels in order)."""
        return torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def prepare(self, q, k, v, g):
        """The recurrence's inputs in fp32: q and k normalised (q scaled by D^-0.5), the gate logits made decays."""
        q, k, v = (t.float() for t in (q, k, v))
        return (l2_normalise(q) * q.shape[-1] ** -0.5, l2_normalise(k), v,
                forget_decay(g, self.A_log, self.dt_bias, self.lower_bound))

    def recurrence(self, q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k, v [S, H, D] as the convolutions left them, g [S, H, D] the forget gate's logits (before dt_bias and
        its activation), beta [S, H] fp32, state [H, D, D] fp32 -> (o [S, H, D], the new state). Plain torch: q and k
        normalised (q scaled), the gate activated, then the recurrence (one token) or its chunked form, in fp32; a
        fast operator does all of it in its kernels."""
        q, k, v, g = self.prepare(q, k, v, g)
        if q.shape[0] == 1:
            return kda_recurrent(q, k, v, g, beta, state)
        return kda_chunked(q, k, v, g, beta, state)

    def forward(self, x, cache_state: KDAState):
        """x [S, hidden], the tokens after those cache_state has seen -> [S, hidden]; updates cache_state."""
        with span("attention", x.device):
            S, H, D = x.shape[0], self.n_heads, self.head_dim
            q, k, v, f_a, b, g_a = self.input_projections(x)
            qkv = torch.cat([q, k, v], dim=-1)  # [S, 3*H*D]
            mixed = causal_conv(qkv, self.conv_weight(), cache_state.conv)
            K1 = cache_state.conv.shape[0]
            cache_state.conv.copy_(torch.cat([cache_state.conv, qkv.to(cache_state.conv.dtype)])[-K1:])
            q, k, v = (t.view(S, H, D) for t in mixed.split(H * D, dim=-1))
            g = self.f_b_proj(f_a).view(S, H, D)
            beta = torch.sigmoid(b.float())
            o, state = self.recurrence(q, k, v, g, beta, cache_state.state)
            cache_state.state.copy_(state)
            gate = self.g_b_proj(g_a).view(S, H, D)
            return self.o_proj(self.o_norm(o.to(x.dtype), gate).reshape(S, H * D))
