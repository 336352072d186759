"""KDA (Kimi Delta Attention): chunked prefill and recurrent decode over a state pool (api.py), the KDA layer
of Kimi Linear (layer.py). The math is in reference.py."""

from .api import HEAD_DIMS, kda_decode, kda_prefill

__all__ = ["kda_prefill", "kda_decode", "HEAD_DIMS"]
