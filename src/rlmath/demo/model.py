"""A tiny decoder-only transformer language model, defined here (no download).

The model is split the way an RLHF trainer needs it: ``hidden_states`` runs
the trunk, and the LM head (``lm_head``) and the optional value head
(``value_head``) are applied by the caller, so that the trainer can apply them
to the *packed* (padding-free) tokens only. See ``rlmath.demo.batch``.

``--model hf-tiny`` builds a small GPT-2 from a config instead (random
weights, needs the optional ``transformers`` package) behind the same
interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DemoLM",
    "ModelConfig",
    "TinyTransformer",
    "build_model",
    "position_ids_from_mask",
]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    max_len: int = 32
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, S]`` (int64) that count only valid tokens.

    With left-padded prompts the first real token gets position 0 whatever the
    padding, so a sequence's logits do not depend on how it was batched.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model)
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class DemoLM(nn.Module):
    """The interface a trainer needs: a trunk, an LM head and an optional value head.

    ``lm_head`` maps hidden ``[..., H]`` to logits ``[..., V]``; ``value_head``
    (once ``add_value_head`` has run) maps hidden ``[..., H]`` to ``[..., 1]``.
    """

    cfg: ModelConfig
    lm_head: nn.Module
    value_head: nn.Linear | None

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def add_value_head(self) -> None:
        """Attach a fresh zero-initialized value head (a critic starts at V = 0)."""
        head = nn.Linear(self.cfg.d_model, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        p = next(self.parameters())
        self.value_head = head.to(p.device, p.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, V]`` (padded layout; used by sampling)."""
        logits: torch.Tensor = self.lm_head(self.hidden_states(input_ids, attention_mask))
        return logits


class TinyTransformer(DemoLM):
    """Pre-LayerNorm GPT-style decoder with learned positions.

    ``lm_head`` maps hidden ``[..., H]`` to logits ``[..., V]``; ``value_head``
    (present when ``with_value_head``) maps hidden ``[..., H]`` to ``[..., 1]``.
    """

    def __init__(self, cfg: ModelConfig, *, with_value_head: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.value_head: nn.Linear | None = None
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual
        # stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
        if with_value_head:
            self.add_value_head()

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[B, S, H]`` for ``input_ids`` ``[B, S]``.

        ``attention_mask`` ``[B, S]`` (1 = real token) hides padding from
        attention. Padding rows attend to themselves only, which keeps them
        finite; their outputs are meaningless and are dropped by the caller.
        """
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        s = input_ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        keys = attention_mask.bool()[:, None, None, :]
        eye = torch.eye(s, dtype=torch.bool, device=input_ids.device)
        attn_mask = (causal & keys) | eye  # [B, 1, S, S]
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, attn_mask)
        out: torch.Tensor = self.ln_f(x)
        return out


class _HFTinyGPT2(DemoLM):
    """A from-config GPT-2 from ``transformers`` behind the TinyTransformer interface."""

    def __init__(self, cfg: ModelConfig, *, with_value_head: bool = False) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_cfg = GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.d_ff,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=3,
            pad_token_id=0,
        )
        self.cfg = cfg
        self.hf = GPT2LMHeadModel(hf_cfg)
        self.lm_head = self.hf.lm_head
        self.value_head: nn.Linear | None = None
        if with_value_head:
            self.add_value_head()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        out = self.hf.transformer(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden


MODEL_KINDS = ("tiny", "hf-tiny")


def build_model(kind: str, cfg: ModelConfig, *, with_value_head: bool = False) -> DemoLM:
    """Build the demo's policy model: ``tiny`` (defined here) or ``hf-tiny``.

    Raises ``RuntimeError`` with install instructions when ``hf-tiny`` is
    asked for and ``transformers`` is not installed.
    """
    if kind == "tiny":
        return TinyTransformer(cfg, with_value_head=with_value_head)
    if kind == "hf-tiny":
        try:
            import transformers  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "--model hf-tiny needs the optional 'transformers' package, which is not "
                "installed; install it with `pip install transformers` or use --model tiny"
            ) from e
        return _HFTinyGPT2(cfg, with_value_head=with_value_head)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")
