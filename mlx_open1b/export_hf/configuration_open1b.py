"""Open-1B configuration for Hugging Face `transformers` (shipped by `open1b export --format hf`;
loaded with `trust_remote_code=True`). Self-contained: needs only `transformers`."""
try:
    from transformers import PreTrainedConfig as _Base
except ImportError:                      # transformers < 5
    from transformers import PretrainedConfig as _Base


class Open1BConfig(_Base):
    """The architecture fields of an open1b export's config.json. layer_windows[l] is layer l's
    sliding window (0: global attention)."""

    model_type = "open1b"

    def __init__(self, vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                 rope_theta=10000.0, rms_norm_eps=1e-6, layer_windows=None, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = float(rope_theta)
        self.rms_norm_eps = float(rms_norm_eps)
        self.layer_windows = list(layer_windows) if layer_windows is not None else [0] * num_hidden_layers
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
