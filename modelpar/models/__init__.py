"""Built-in models: a GPT-style decoder, the classic MLPs, a small CNN."""

from modelpar.models.cnn import build_cnn
from modelpar.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from modelpar.models.mlp import MLP_PRESETS, build_mlp

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_gpt", "build_mlp", "MLP_PRESETS", "build_cnn", "build_model",
           "MODEL_NAMES"]

MODEL_NAMES = tuple(PRESETS) + tuple(MLP_PRESETS) + ("cnn",)


def build_model(name: str, *, device: str = "cpu", seed: int | None = 0, **overrides):
    """Build a built-in model by name (one of ``MODEL_NAMES``). Raises ValueError if unknown."""
    if name in PRESETS:
        return build_gpt(name, device=device, seed=seed, **overrides)
    if name in MLP_PRESETS:
        return build_mlp(name, device=device, seed=seed)
    if name == "cnn":
        return build_cnn(seed=seed)
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
