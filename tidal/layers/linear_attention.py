"""Gated DeltaNet (Qwen3-Next's linear attention) over per-sequence recurrent state.

Per token t and value head h the layer keeps a state matrix S [Dk, Dv] and applies the gated delta rule
    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - k_t^T S))^T;   o_t = q_t^T S
after a depthwise causal conv (width K) over the concatenated q/k/v projections. Prefill uses the
chunked (WY / UT-transform) form, one matmul-heavy block of `CHUNK` tokens at a time; one-token
decode steps use the recurrent form, batched over sequences. Both read and write the sequence's slot
in the state pool (`ForwardContext.state_cache`, `SeqSlice.state_slot`): a sequence starting at
position 0 starts from zeros, a later prefill chunk or decode step continues from the slot.
All state arithmetic is float32, as in the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig
from tidal.layers.context import get_forward_context
from tidal.layers.norm import GatedRMSNorm

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [H, T, Dk] (normalised, q scaled); v [H, T, Dv]; g (log decay), beta [H, T];
    state [H, Dk, Dv]. All float32. Returns (out [H, T, Dv], final state [H, Dk, Dv])."""
    H, T, Dk = k.shape
    pad = (-T) % chunk
    if pad:  # padded steps have k = 0, beta = 0, g = 0: they neither decay nor write the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))               # [H, n, C, D]
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)             # [H, n, C]
    gc = g.cumsum(-1)                                                       # log decay from chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = prod of exp(g) over (j, i], for j <= i (causal within the chunk)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()   # [H, n, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Within a chunk the delta rule is a unit lower-triangular system (I + L) X = B (the UT transform).
    lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)                # [H, n, C, C]
    system = lower + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)       # [H, n, C, Dv]
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False,
                                      unitriangular=True)                                     # [H, n, C, Dk]
    intra = (q @ k.transpose(-1, -2)) * decay                                # [H, n, C, C], causal
    q_decayed = q * gc.exp()[..., None]                                      # reads the chunk-start state
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]                     # writes decayed to chunk end
    chunk_decay = gc[..., -1].exp()[..., None, None]                         # [H, n, 1, 1]
    out = torch.empty_like(v)
    S = state
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S                                        # [H, C, Dv] corrections
        out[:, i] = q_decayed[:, i] @ S + intra[:, i] @ v_new
        S = S * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk, -1)[:, :T], S


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H];
    state [B, H, Dk, Dv]. Returns (out [B, H, Dv], new state)."""
    S = state * g.exp()[..., None, None]
    recalled = (S * k[..., :, None]).sum(-2)                                 # [B, H, Dv] = k^T S
    delta = (v - recalled) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return (S * q[..., :, None]).sum(-2), S


class GatedDeltaNet(nn.Module):
    """Qwen3-Next `linear_attn`: checkpoint names in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log,
    norm, out_proj."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, device):
        super().__init__()
        self.layer = layer
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        mk = dict(bias=False, dtype=dtype, device=device)
        self._make_projections(cfg.hidden_size, mk)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, **mk)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=dtype, device=device))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype, device)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, **mk)
        self.requires_grad_(False)

    def _make_projections(self, hidden: int, mk: dict) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, **mk)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, **mk)

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> conv input [T, conv_dim] (q | k | v), z [T, Hv, Dv], b, a [T, Hv].
        Qwen3-Next groups the projections per key head: [q k v z] and [b a] for each of Hk groups."""
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        T, Hk, r = qkvz.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        q, k, v, z = qkvz.view(T, Hk, -1).split(
            [self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], dim=-1)
        b, a = ba.view(T, Hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)   # [T, conv_dim]
        return mixed, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, -1), a.reshape(T, -1)

    def _heads(self, mixed: torch.Tensor):
        """conv output [..., conv_dim] -> q, k [..., Hv, Dk] (normalised, q scaled, float32), v [..., Hv, Dv]."""
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead, r = mixed.shape[:-1], self.num_v_heads // self.num_k_heads
        q = q.reshape(*lead, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*lead, self.num_k_heads, self.head_k_dim)
        if r > 1:  # each key head serves r consecutive value heads
            q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        q = l2norm(q) * self.head_k_dim ** -0.5
        return q, l2norm(k), v.reshape(*lead, self.num_v_heads, self.head_v_dim)

    def forward(self, x: torch.Tensor, cos=None, sin=None) -> torch.Tensor:   # x [T, hidden]
        T = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.float().sigmoid()                                               # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv] log decay
        ctx = get_forward_context()
        pool = ctx.state_cache
        if pool is None or any(s.state_slot is None for s in ctx.seqs):
            raise RuntimeError("linear-attention layer needs a state pool and a state slot per sequence")
        conv_all, ssm_all = pool.conv[self.layer], pool.ssm[self.layer]          # [slots, C, K-1], [slots, Hv, Dk, Dv]
        weight = self.conv1d.weight.float()                                      # [C, 1, K]
        core = torch.empty(T, self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=x.device)
        decode = [s for s in ctx.seqs if s.q_len == 1 and s.start > 0]
        if decode:
            rows = torch.tensor([s.q_start for s in decode], device=x.device)
            slots = torch.tensor([s.state_slot for s in decode], device=x.device)
            window = torch.cat((conv_all[slots], mixed[rows].float()[:, :, None]), dim=-1)   # [B, C, K]
            conv_all[slots] = window[:, :, 1:]
            conv = F.silu(F.conv1d(window, weight, groups=self.conv_dim))[:, :, 0]       # [B, C]
            q, k, v = self._heads(conv)
            out, new_state = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], ssm_all[slots])
            ssm_all[slots] = new_state
            core[rows] = out
        for s in ctx.seqs:
            if s.q_len == 1 and s.start > 0:
                continue
            rows = slice(s.q_start, s.q_start + s.q_len)
            if s.start == 0:  # a new sequence: zero conv history and state
                prev = torch.zeros(self.conv_dim, self.kernel - 1, dtype=torch.float32, device=x.device)
                state = torch.zeros_like(ssm_all[s.state_slot])
            else:
                prev, state = conv_all[s.state_slot], ssm_all[s.state_slot]
            window = torch.cat((prev, mixed[rows].float().T), dim=-1)                     # [C, K-1+n]
            conv_all[s.state_slot] = window[:, window.shape[1] - (self.kernel - 1):]   # last K-1 inputs
            conv = F.silu(F.conv1d(window[None], weight, groups=self.conv_dim))[0].T      # [n, C]
            q, k, v = self._heads(conv)                                                   # [n, Hv, D]
            out, new_state = chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                    g[rows].T, beta[rows].T, state)
            ssm_all[s.state_slot] = new_state
            core[rows] = out.transpose(0, 1)
        core = self.norm(core.to(x.dtype), z)                                    # [T, Hv, Dv]
        return self.out_proj(core.reshape(T, self.value_dim))


class GatedDeltaNetSplitProj(GatedDeltaNet):
    """Qwen3.5 layout of the same layer: separate in_proj_qkv (q | k | v flat), in_proj_z, in_proj_b, in_proj_a."""

    def _make_projections(self, hidden: int, mk: dict) -> None:
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, **mk)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, **mk)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, **mk)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, **mk)

    def _project(self, x: torch.Tensor):
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
