"""Building blocks: seeded weights, RMSNorm, rotary position embedding, SwiGLU MLP.

Weights are drawn on the host from one `torch.Generator` in construction order, in float32,
so a seed gives the same model on every device; the model casts and moves them afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def seeded_weight(shape: tuple[int, ...], std: float, generator: torch.Generator) -> nn.Parameter:
    """A frozen parameter drawn from N(0, std^2) on the host."""
    data = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    return nn.Parameter(data, requires_grad=False)


def linear_weight(out_features: int, in_features: int, generator: torch.Generator, gain: float = 1.0) -> nn.Parameter:
    """[out, in] with std gain / sqrt(in): activations keep their scale through the layer."""
    return seeded_weight((out_features, in_features), gain / in_features**0.5, generator)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, generator: torch.Generator, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden_size, generator=generator), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] by its tokens' positions (rotate-half layout).

    The angles are computed in float32 from the positions alone, so a token gets the same
    rotation whether it is embedded in a dense sequence or in a paged batch.
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq  # [num_tokens, head_dim / 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, generator: torch.Generator) -> None:
        super().__init__()
        self.gate_up = linear_weight(2 * intermediate_size, hidden_size, generator)
        self.down = linear_weight(hidden_size, intermediate_size, generator, gain=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)
