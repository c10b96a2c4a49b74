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

Key/value cache: `use_cache=True` (generate()'s default) keeps every layer's keys (after QK-norm and
RoPE) and values in float32 in a transformers `DynamicCache` (passed as `cache`, transformers >= 5,
or `past_key_values`, 4.x), so each new token runs alone. A cache layer may hold only the last
keys (transformers keeps a sliding layer's last window - 1): the keys it returns are always the last
ones of the sequence, so the masks are built on sequence slots, position i of a row's real tokens
(left padding) being slot i + its padding.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
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

    def forward(self, x, pos, keep, cache=None, layer_idx=0):
        """x (B, T, d) at positions pos (B, T), the last T of keep's (B, past + T) slots (False: padding)."""
        B, T, _ = x.shape
        H, G, D = self.H, self.G, self.D
        q = _rope(_rms(self.q_proj(x).view(B, T, H, D), None, self.eps), pos, self.theta)
        k = _rope(_rms(self.k_proj(x).view(B, T, G, D), None, self.eps), pos, self.theta).transpose(1, 2)
        v = self.v_proj(x).view(B, T, G, D).float().transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)         # (B, G, K, D): the keys of the last K slots
        n, K = keep.shape[1], k.shape[2]
        qs = torch.arange(n - T, n, device=x.device)[:, None]
        ks = torch.arange(n - K, n, device=x.device)[None, :]
        qh = q.transpose(1, 2)
        kh = k.repeat_interleave(H // G, dim=1)
        vh = v.repeat_interleave(H // G, dim=1)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(D))
        vis = keep[:, None, n - K:] & (ks <= qs)
        if self.window:
            vis = vis & (qs - ks < self.window)
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

    def forward(self, h, pos, keep, cache=None, layer_idx=0):
        h = h + self.self_attn(self.input_layernorm(h), pos, keep, cache, layer_idx)
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

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        """The final norm's output for input_ids (B, T), which follow the cache's slots; attention_mask
        covers every slot (cached and new; 0: left padding), or only the new ones."""
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        keep = torch.ones(B, past + T, dtype=torch.bool, device=input_ids.device)
        if attention_mask is not None:
            keep[:, past + T - attention_mask.shape[1]:] = attention_mask.bool()
        if position_ids is None:         # left padding: a row's first real token is position 0
            position_ids = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        h = self.embed_norm(self.embed_tokens(input_ids))
        for l, layer in enumerate(self.layers):
            h = layer(h, position_ids, keep, cache, l)
        return self.norm(h)


# the output's cache field: `cache` from transformers 5, `past_key_values` before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class Open1BForCausalLM(Open1BPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = Open1BModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, cache=None, past_key_values=None,
                                      use_cache=True, **kwargs):
        """The tokens the cache does not hold yet (all of them without a cache), the whole mask."""
        cache = cache if cache is not None else past_key_values
        if not use_cache:
            cache = None
        if cache is not None:
            input_ids = input_ids[:, cache.get_seq_length():]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache, "use_cache": use_cache}

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cache=None,
                past_key_values=None, use_cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", False)
        if not use_cache:
            cache = None
        elif cache is None:
            cache = DynamicCache(config=self.config)
        hn = self.model(input_ids, attention_mask, position_ids, cache)
        logits = self.lm_head(hn).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
