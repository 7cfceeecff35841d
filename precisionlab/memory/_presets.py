"""Model presets: the GPT-3 family as published.

Source: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 ("Sizes,
architectures, and learning hyper-parameters (batch size in tokens and learning rate) of the
models which we trained"). All models use a context window of n_ctx = 2048 tokens and GPT-2's
byte-level BPE vocabulary of 50257 tokens (Radford et al. 2019). The values are copied as
printed: d_model = 5140 for GPT-3 13B (n_heads x d_head = 5120 there), n_heads x d_head = 3072
for GPT-3 XL (d_model 2048), and the rounded n_params, so that the textbook figures
(175e9 x 2 bytes = 350 GB) come out exactly. Attention activations use n_heads x d_head.
"""

from __future__ import annotations

from precisionlab.memory._estimate import ModelSpec

__all__ = ["ALIASES", "PRESETS", "get_preset", "preset_names"]

_N_CTX = 2048
_VOCAB = 50257


def _gpt3(
    name: str, n_params: float, n_layers: int, d_model: int, n_heads: int, d_head: int,
    batch_tokens: float, lr: float,
) -> ModelSpec:  # fmt: skip
    return ModelSpec(
        name=name,
        n_params=round(n_params),
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_head,
        vocab=_VOCAB,
        seq_len=_N_CTX,
        batch_tokens=round(batch_tokens),
        learning_rate=lr,
    )


#: Table 2.1 of Brown et al. 2020, row by row: n_params, n_layers, d_model, n_heads, d_head,
#: batch size (tokens), learning rate.
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _gpt3("gpt3-small", 125e6, 12, 768, 12, 64, 0.5e6, 6.0e-4),
        _gpt3("gpt3-medium", 350e6, 24, 1024, 16, 64, 0.5e6, 3.0e-4),
        _gpt3("gpt3-large", 760e6, 24, 1536, 16, 96, 0.5e6, 2.5e-4),
        _gpt3("gpt3-xl", 1.3e9, 24, 2048, 24, 128, 1e6, 2.0e-4),
        _gpt3("gpt3-2.7b", 2.7e9, 32, 2560, 32, 80, 1e6, 1.6e-4),
        _gpt3("gpt3-6.7b", 6.7e9, 32, 4096, 32, 128, 2e6, 1.2e-4),
        _gpt3("gpt3-13b", 13.0e9, 40, 5140, 40, 128, 2e6, 1.0e-4),
        _gpt3("gpt3-175b", 175.0e9, 96, 12288, 96, 128, 3.2e6, 0.6e-4),
    )
}

# The paper names the first four by size class; these spell them by parameter count.
ALIASES: dict[str, str] = {
    "gpt3-125m": "gpt3-small",
    "gpt3-350m": "gpt3-medium",
    "gpt3-760m": "gpt3-large",
    "gpt3-1.3b": "gpt3-xl",
    "gpt3": "gpt3-175b",
}


def preset_names() -> list[str]:
    """Preset names in table order."""
    return list(PRESETS)


def get_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case insensitive; aliases such as ``gpt3-125m`` accepted).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        known = ", ".join([*PRESETS, *ALIASES])
        raise ValueError(f"unknown preset {name!r}; allowed: {known}")
    return PRESETS[key]
