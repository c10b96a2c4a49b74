"""Open-1B for Hugging Face `transformers` (shipped by `open1b export --format hf`; loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`). Self-contained: needs only
`torch` and `transformers`.

The architecture of mlx-open1b's model program, in plain PyTorch (not its reproducible arithmetic):
    h = RMSNorm(embed_tokens[ids], embed_norm)
    per layer: a = RMSNorm(h, input_layernorm); q, k, v = a Wqᵀ, a Wkᵀ, a Wvᵀ
               q, k = gain-free RMSNorm of each head, then RoPE (rotate-half, i pairs with i + D/2)
               o = causal grouped-query attention, scale 1/sqrt(D), keys within layer_windows[l]
                   positions (0: all); h = h + o Woᵀ
               f = RMSNorm(h, post_attention_layernorm); h = h + (silu(f Wgᵀ) * f Wuᵀ) Wdᵀ
    logits = RMSNorm(h, norm) lm_headᵀ
Norms, RoPE and softmax are computed in float32 whatever the parameter dtype.
Generation recomputes the whole sequence for each new token (no key/value cache): exact, and
fast enough for the small models this project trains.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_open1b import Open1BConfig


def _rms(x, g, eps):
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y if g is None else y * g.float()


class _Norm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps).to(x.dtype)


def _rope(x, pos, theta):
    """x (B, T, R, D), pos (B, T) → rotate-half RoPE, angles in float64 as mlx-open1b's tables."""
    D = x.shape[-1]
    i = torch.arange(D // 2, dtype=torch.float64, device=x.device)
    ang = pos.to(torch.float64)[..., None] * (theta ** (-2.0 * i / D))          # (B, T, D/2)
    c, s = torch.cos(ang).float()[:, :, None, :], torch.sin(ang).float()[:, :, None, :]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg, window):
        super().__init__()
        d, H, G, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.G, self.D, self.window = H, G, D, window
        self.eps, self.theta = cfg.rms_norm_eps, cfg.rope_theta
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, G * D, bias=False)
        self.v_proj = nn.Linear(d, G * D, bias=False)
        self.o_proj = nn.Linear(H * D, d, bias=False)

    def forward(self, x, pos, keep):
        B, T, _ = x.shape
        H, G, D = self.H, self.G, self.D
        q = _rope(_rms(self.q_proj(x).view(B, T, H, D), None, self.eps), pos, self.theta)
        k = _rope(_rms(self.k_proj(x).view(B, T, G, D), None, self.eps), pos, self.theta)
        v = self.v_proj(x).view(B, T, G, D).float()
        qh = q.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(H // G, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(H // G, dim=1)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(D))
        vis = keep[:, None] & (pos[:, :, None] >= pos[:, None, :])
        if self.window:
            vis = vis & (pos[:, :, None] - pos[:, None, :] < self.window)
        s = s.masked_fill(~vis[:, None], torch.finfo(torch.float32).min)      # finite: a padded row stays finite
        o = torch.matmul(torch.softmax(s, dim=-1), vh).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(o.to(x.dtype))


class _MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg, window):
        super().__init__()
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg, window)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, h, pos, keep):
        h = h + self.self_attn(self.input_layernorm(h), pos, keep)
        return h + self.mlp(self.post_attention_layernorm(h))


class Open1BPreTrainedModel(PreTrainedModel):
    config_class = Open1BConfig
    base_model_prefix = "model"
    _no_split_modules = ["_Layer"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, _Norm):
            nn.init.ones_(module.weight)


class Open1BModel(Open1BPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([_Layer(config, config.layer_windows[l]) for l in range(config.num_hidden_layers)])
        self.norm = _Norm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        keep = (torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if attention_mask is None
                else attention_mask.bool())
        if position_ids is None:         # left padding: a row's first real token is position 0
            position_ids = (keep.long().cumsum(-1) - 1).clamp(min=0)
        h = self.embed_norm(self.embed_tokens(input_ids))
        for layer in self.layers:
            h = layer(h, position_ids, keep)
        return self.norm(h)


class Open1BForCausalLM(Open1BPreTrainedModel, GenerationMixin):
    _supports_cache_class = False

    def __init__(self, config):
        super().__init__(config)
        self.model = Open1BModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}       # the whole sequence, every token

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        hn = self.model(input_ids, attention_mask, position_ids)
        logits = self.lm_head(hn).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
