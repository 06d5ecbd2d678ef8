"""``install()`` / ``uninstall()``: make a running TRL compute with rlmath (see ``rlmath.compat.trl``).

TRL has had two structures that matter here:

* **function imports** (TRL 0.24 to 1.14): the trainers compute log-probs and
  entropies from dense logits with ``trl.trainer.utils.selective_log_softmax``,
  ``entropy_from_logits`` and (1.14) ``selective_log_softmax_and_entropy``,
  each trainer module holding its own binding (``from .utils import ...``).
  ``install()`` replaces the attribute in ``trl.trainer.utils`` and in every
  loaded ``trl.*`` module bound to TRL's function.
* **a fused LM head** (TRL 1.15, 1.16): the trainers call
  ``add_fused_lm_head(model, ...)`` at construction, which replaces
  ``model.forward`` so that ``model(..., labels=, fused_lm_head=True)`` returns
  per-token log-probs and entropies without the logits (TRL's own chunked
  kernel). ``install()`` replaces ``add_fused_lm_head`` the same way, by one that
  computes them with :class:`rlmath.FusedLMHeadLogProbs`; and it replaces
  ``GRPOTrainer._compute_loss`` by one that computes the loss with
  :func:`rlmath.compat.trl.grpo_loss` (metrics: TRL's keys, Python floats).

The fused head is installed on the model (through its ``forward``), not in
``GRPOTrainer._get_per_token_logps_and_entropies``: that method receives the
model wrapped by accelerate (DDP, FSDP, DeepSpeed), and only a call of the
wrapper's ``forward`` keeps their gradient synchronisation and parameter
gathering; TRL's method (batching, multimodal inputs) is kept as it is.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import sys
import types
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

#: TRL versions ``install()`` was tested on (0.24.0 and 1.16.0); the versions
#: between are recognised by structure (see the module docstring).
TESTED_TRL_VERSIONS = ("0.24.0", "1.16.0")

#: TRL releases whose ``GRPOTrainer._compute_loss`` (and its metrics) the
#: replacement was written against (1.15's is the same as 1.16's).
_LOSS_VERSIONS = ("1.15.", "1.16.")

_FUNCTIONS = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy")
_EXTRA_SCALES = ("logits_scaling", "lm_head_multiplier", "output_multiplier")
_OURS_OUTPUTS = frozenset({"log_probs", "entropy"})


class _Patch(NamedTuple):
    label: str
    target: Any
    key: str
    original: Any


_patches: list[_Patch] = []
_originals: dict[str, Any] = {}


def _import_trl(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"rlmath.compat.trl.install() patches TRL, but {name} could not be imported ({err}). "
            "Install TRL (tested: "
            + ", ".join(TESTED_TRL_VERSIONS)
            + ") or call the functions of rlmath.compat.trl directly: they do not need TRL."
        ) from err


def _trl_version() -> str:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:
        return "unknown"


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_patches)


def _record() -> dict[str, Any]:
    return {p.label: p.original for p in _patches}


def _set(label: str, target: Any, key: str, value: Any) -> None:
    _patches.append(_Patch(label, target, key, getattr(target, key)))
    setattr(target, key, value)


def install(*, loss: bool | None = None) -> dict[str, Any]:
    """Make TRL's trainers compute log-probs, entropies and the GRPO loss with rlmath.

    **Call it first**, before constructing a trainer (TRL >= 1.15 installs its
    fused head on the model in the trainer's ``__init__``) and before your own
    ``from trl.trainer.utils import selective_log_softmax``.

    * TRL 0.24 to 1.14: ``selective_log_softmax``, ``entropy_from_logits`` and
      ``selective_log_softmax_and_entropy`` (where TRL has them) are replaced
      by rlmath.compat.trl's in ``trl.trainer.utils`` and in every loaded
      ``trl.*`` module that bound TRL's function (every trainer), so all
      trainers (GRPO, RLOO, DPO, KTO, SFT, ...) use them. The loss stays TRL's.
    * TRL 1.15, 1.16: ``add_fused_lm_head`` is replaced in the same places by one
      whose ``fused_lm_head=True`` forward computes log-probs and entropies
      with :class:`rlmath.FusedLMHeadLogProbs` (fp32 per chunk, the same
      outputs, ``loss`` and ``label_mask`` as TRL's). It hands over to TRL's
      own head for what it does not cover: other requested outputs
      (``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), MoE router losses
      (``output_router_logits``), ``logits_scaling`` / ``lm_head_multiplier`` /
      ``output_multiplier`` heads, and vision-language models before
      transformers 5. ``GRPOTrainer._compute_loss`` is replaced by one using
      :func:`rlmath.compat.trl.grpo_loss` for every ``loss_type`` it covers;
      with the entropy bonus (``entropy_coef``/adaptive entropy), an MoE aux
      loss, ``delta`` at sequence level, or VESPO with an entropy or
      off-policy mask, that call runs TRL's own ``_compute_loss``. The
      logged metrics have TRL's keys and Python float values;
      ``vespo/phi_seq_mean`` averages over sequences with a valid token.
      ``trl.experimental`` trainers and ``RLOOTrainer``'s loss are not changed.

    Args:
        loss: patch ``GRPOTrainer._compute_loss``. ``None`` (default): where the
            installed TRL has the fused-head structure and is a release the
            replacement was written against (1.15, 1.16; a newer one keeps
            TRL's loss, with a warning); ``True``: require the structure (a
            ``RuntimeError`` otherwise; a warning on an unverified release);
            ``False``: never.

    Idempotent. Returns ``{qualified name: TRL's original}`` for everything
    replaced; :func:`uninstall` restores each exactly.

    Raises:
        ImportError: TRL is not importable.
        RuntimeError: the installed TRL has neither structure (nothing to
            patch), or ``loss=True`` where TRL's loss cannot be patched.
        ValueError: already installed with a different ``loss``.
    """
    if _patches:
        if loss is not None and loss != _originals.get("loss"):
            raise ValueError(
                "rlmath.compat.trl is already installed with another `loss`; call uninstall() first"
            )
        return _record()
    utils = _import_trl("trl.trainer.utils")
    version = _trl_version()
    fused = getattr(utils, "add_fused_lm_head", None)
    present = [name for name in _FUNCTIONS if callable(getattr(utils, name, None))]
    # Trainer modules imported later bind the patched trl.trainer.utils attributes; the
    # loss patch needs GRPOTrainer itself (fused-head structure only).
    trainer = None
    if fused is not None and loss is not False:
        trainer = getattr(_import_trl("trl.trainer.grpo_trainer"), "GRPOTrainer", None)
    if fused is None and "selective_log_softmax" not in present:
        raise RuntimeError(
            f"rlmath.compat.trl.install(): TRL {version} has neither "
            "trl.trainer.utils.selective_log_softmax nor add_fused_lm_head; this structure is not "
            "recognised (tested: " + ", ".join(TESTED_TRL_VERSIONS) + "). Nothing was patched."
        )
    verified = version.startswith(_LOSS_VERSIONS)
    patch_loss = fused is not None and verified if loss is None else bool(loss)
    if fused is not None and loss is not False and not verified:
        warnings.warn(
            f"rlmath.compat.trl.install(): GRPOTrainer._compute_loss of TRL {version} was not "
            "verified (written against TRL 1.15 and 1.16); "
            + ("it is replaced as asked (loss=True)" if loss else "TRL's loss is kept"),
            stacklevel=2,
        )
    if patch_loss and (fused is None or not _loss_patchable(trainer)):
        raise RuntimeError(
            f"rlmath.compat.trl.install(loss=True): GRPOTrainer._compute_loss of TRL {version} "
            "does not have the structure rlmath replaces (the fused-head trainer of TRL >= 1.15). "
            "Nothing was patched; use install(loss=False)."
        )

    from rlmath.compat import trl as ours

    replacements: dict[int, Any] = {}
    for name in present:
        original = getattr(utils, name)
        replacements[id(original)] = (name, original, getattr(ours, name))
    if fused is not None:
        _originals["add_fused_lm_head"] = fused
        replacements[id(fused)] = ("add_fused_lm_head", fused, _add_fused_lm_head)
    # Every loaded trl.* module whose attribute is one of TRL's functions (the
    # trainers' `from .utils import ...`), trl.trainer.utils itself included.
    for modname, module in sorted(sys.modules.items()):
        if not (modname == "trl" or modname.startswith("trl.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            hit = replacements.get(id(value))
            if hit is not None and value is hit[1]:
                _set(f"{modname}.{attr}", module, attr, hit[2])
    if patch_loss:
        assert trainer is not None
        _originals["_compute_loss"] = trainer._compute_loss
        _set("trl.trainer.grpo_trainer.GRPOTrainer._compute_loss", trainer, "_compute_loss",
             _compute_loss)  # fmt: skip
    _originals["loss"] = patch_loss
    return _record()


def uninstall() -> None:
    """Undo :func:`install`: every patched attribute gets TRL's original back. Idempotent."""
    while _patches:
        patch = _patches.pop()
        setattr(patch.target, patch.key, patch.original)
    _originals.clear()


# ---------------------------------------------------------------------------
# TRL 1.15, 1.16: the fused LM head.


@dataclass
class _FusedOutput:
    """Stand-in for TRL's ``FusedCausalLMOutput`` where TRL does not define it."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def _output_class() -> Any:
    utils = sys.modules.get("trl.trainer.utils")
    return getattr(utils, "FusedCausalLMOutput", _FusedOutput)


def _head_options(model: Any) -> dict[str, Any] | None:
    """``logit_scale`` / ``softcap`` of the model's head, or None where rlmath does not cover it."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        import transformers

        if int(transformers.__version__.split(".")[0]) < 5:
            return None  # the language backbone is not `base_model` there
    if getattr(text, "output_router_logits", False):
        return None  # MoE load-balancing loss: TRL's head adds it
    if any(getattr(text, name, None) is not None for name in _EXTRA_SCALES):
        return None
    scale = getattr(text, "logit_scale", None)
    softcap = getattr(text, "final_logit_softcapping", None)
    return {"logit_scale": 1.0 if scale is None else float(scale), "softcap": softcap}


def _add_fused_lm_head(
    model: Any,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """rlmath's ``add_fused_lm_head``: TRL's contract, log-probs and entropies by rlmath.

    ``model(..., labels=labels, fused_lm_head=True)`` runs the backbone, scores
    the hidden state at position ``t`` against ``labels[:, t + 1]`` (or the
    pre-shifted ``shift_labels``) with :class:`rlmath.FusedLMHeadLogProbs`,
    and returns TRL's output type with ``log_probs`` and ``entropy`` (0 where
    the label is -100), ``label_mask`` and the mean negative log-likelihood
    ``loss`` (over ``num_items_in_batch`` when given). Without
    ``fused_lm_head`` the model's own forward runs.
    """
    options = _head_options(model)
    original = _originals["add_fused_lm_head"]
    if options is None or not set(outputs) <= _OURS_OUTPUTS:
        original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                 outputs=outputs)  # fmt: skip
        return
    import rlmath

    want_entropy = "entropy" in outputs
    plain_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(
        self: Any,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels,
                     "num_items_in_batch": num_items_in_batch}  # fmt: skip
            kwargs.update({k: v for k, v in extra.items() if v is not None})
            return plain_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            if labels is None:
                raise ValueError("fused_lm_head=True needs labels or shift_labels")
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        head = self.get_output_embeddings()
        hidden = hidden.to(head.weight.device)
        targets = targets.to(head.weight.device)
        context: Any = nullcontext()
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
            context = torch.autocast(hidden.device.type, enabled=False)
        fused = rlmath.FusedLMHeadLogProbs(head, temperature=temperature, ignore_index=-100,
                                           **options)  # fmt: skip
        with context:
            log_probs, entropy = fused(hidden, targets, return_entropy=want_entropy)
        mask = targets != -100
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return _output_class()(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask
        )

    model.forward = types.MethodType(forward, model)


# ---------------------------------------------------------------------------
# TRL 1.15, 1.16: GRPOTrainer's loss.

_NEEDED = ("_get_per_token_logps_and_entropies", "get_off_policy_mask", "get_high_entropy_mask")


def _loss_patchable(trainer: Any) -> bool:
    if trainer is None or not all(hasattr(trainer, name) for name in _NEEDED):
        return False
    params = inspect.signature(trainer._get_per_token_logps_and_entropies).parameters
    return {"compute_entropy", "compute_aux_loss"} <= set(params)


def _stock_only(self: Any) -> bool:
    """Where the patched loss hands over to TRL's (documented in ``install``)."""
    from rlmath.compat.trl import TRL_LOSS_TYPES

    if self.loss_type not in TRL_LOSS_TYPES:
        return True
    if getattr(self, "_entropy_bonus_enabled", False) or getattr(self, "aux_loss_enabled", False):
        return True
    if self.importance_sampling_level == "sequence" and self.args.delta is not None:
        return True
    extra_masks = self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None
    return self.loss_type == "vespo" and extra_masks


def _mean_over_processes(self: Any, values: torch.Tensor, mask: torch.Tensor) -> float:
    """Masked mean over every process, as a Python float (one value per row for ``(B, 1)``)."""
    values = values.detach().float()
    if values.shape[-1] == 1:
        total, count = values.sum(), torch.tensor(float(values.shape[0]), device=values.device)
    else:
        weight = mask.to(values.dtype)
        total, count = (values * weight).sum(), weight.sum()
    totals = self.accelerator.reduce(torch.stack([total, count]), reduction="sum")
    return float((totals[0] / totals[1].clamp(min=1.0)).item())


def _row_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its valid tokens (NaN for a row without any); ``(B, 1)`` squeezed."""
    values = values.detach().float()
    if values.shape[-1] == 1:
        return values.squeeze(-1)
    weight = mask.to(values.dtype)
    return (values * weight).sum(-1) / weight.sum(-1)


def _extreme(values: torch.Tensor, largest: bool) -> float:
    finite = values[~torch.isnan(values)]
    if finite.numel() == 0:
        return math.nan
    return float((finite.max() if largest else finite.min()).item())


def _compute_loss(self: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``GRPOTrainer._compute_loss`` computed with :func:`rlmath.compat.trl.grpo_loss`."""
    if _stock_only(self):
        return _originals["_compute_loss"](self, model, inputs)
    from rlmath.compat.trl import grpo_loss

    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    # The model inputs beyond the text ones (images, token types), by the method's own names.
    params = list(inspect.signature(self._get_per_token_logps_and_entropies).parameters)
    extra = {name: inputs.get(name) for name in params[params.index("compute_aux_loss") + 1 :]}
    per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
        compute_aux_loss=False, **extra,
    )  # fmt: skip

    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old

    # Token weights TRL multiplies into the policy term (not the KL term, not the normaliser).
    weights: list[torch.Tensor] = []
    if self.off_policy_mask_threshold is not None:
        sampling = inputs.get("sampling_per_token_logps", old)
        off_policy = self.get_off_policy_mask(
            advantages=advantages, per_token_logps=per_token_logps,
            sampling_per_token_logps=sampling, mask=mask,
            off_policy_threshold=self.off_policy_mask_threshold,
        )  # fmt: skip
        weights.append(off_policy)
    if self.top_entropy_quantile < 1.0:
        weights.append(self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile))
    vespo = self.loss_type == "vespo"
    if self.use_vllm and self.vllm_importance_sampling_correction and not vespo:
        weights.append(inputs["importance_sampling_ratio"])
    token_weight: torch.Tensor | None = None
    for w in weights:
        w = w.to(per_token_logps.dtype)
        token_weight = w if token_weight is None else token_weight * w
    if token_weight is not None:
        token_weight = token_weight.expand(per_token_logps.shape)

    mode = "train" if self.model.training else "eval"
    accumulation = int(self.current_gradient_accumulation_steps) if mode == "train" else 1
    num_items = None
    if self.loss_type in ("dapo", "cispo", "vespo"):
        # num_items_in_batch counts the generation batch: one accumulation window's share of it.
        num_items = inputs["num_items_in_batch"].clamp(min=1.0)
        if mode == "train":
            num_items = num_items * accumulation / self.args.steps_per_generation
    args = self.args
    loss, _ = grpo_loss(
        per_token_logps, old, advantages, mask, loss_type=self.loss_type,
        epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, delta=args.delta,
        importance_sampling_level=self.importance_sampling_level, beta=self.beta,
        ref_per_token_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
        use_bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
        importance_sampling_ratio=inputs.get("importance_sampling_ratio") if vespo else token_weight,
        max_completion_length=self.max_completion_length, num_items_in_batch=num_items,
        num_processes=self.accelerator.num_processes, gradient_accumulation_steps=accumulation,
        sapo_temperature_pos=getattr(args, "sapo_temperature_pos", 1.0),
        sapo_temperature_neg=getattr(args, "sapo_temperature_neg", 1.05),
        vespo_k_pos=getattr(args, "vespo_k_pos", 2.0),
        vespo_lambda_pos=getattr(args, "vespo_lambda_pos", 3.0),
        vespo_k_neg=getattr(args, "vespo_k_neg", 3.0),
        vespo_lambda_neg=getattr(args, "vespo_lambda_neg", 2.0),
    )  # fmt: skip
    _log_metrics(self, mode, per_token_logps, old, advantages, mask, entropies, inputs)
    return loss


def _log_metrics(
    self: Any,
    mode: str,
    logps: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropies: torch.Tensor,
    inputs: dict[str, Any],
) -> None:
    """TRL's metric keys, each appended as a Python float (global over processes)."""
    import rlmath

    metrics = self._metrics[mode]
    log_ratio = (logps.detach() - old.detach()).float()
    if self.importance_sampling_level == "sequence":
        log_ratio = rlmath.masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    if self.beta != 0.0:
        ref = inputs["ref_per_token_logps"].detach().float()
        kl = rlmath.kl_penalty(logps.detach().float(), ref, "k3", k3_max=None)
        if getattr(self.args, "use_bias_correction_kl", False):
            kl = kl * ratio
        metrics["kl"].append(_mean_over_processes(self, kl, mask))
    metrics["entropy"].append(_mean_over_processes(self, entropies, mask))
    if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
        region = torch.maximum(low, high)
        for key, value in (("low", low), ("high", high), ("region", region)):
            metrics[f"clip_ratio/{key}_mean"].append(_mean_over_processes(self, value, mask))
        gather = self.accelerator.gather
        metrics["clip_ratio/low_min"].append(_extreme(gather(_row_means(low, mask)), False))
        metrics["clip_ratio/high_max"].append(_extreme(gather(_row_means(high, mask)), True))
    elif self.loss_type == "cispo":
        clipped = ((ratio > self.epsilon_high) & (adv > 0)).float()
        metrics["cispo_clip_ratio"].append(_mean_over_processes(self, clipped, mask))
    elif self.loss_type == "vespo":
        phi = _vespo_phi_mean(self, logps, old, adv, mask, inputs)
        metrics["vespo/phi_seq_mean"].append(phi)


def _vespo_phi_mean(
    self: Any,
    logps: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    inputs: dict[str, Any],
) -> float:
    """The mean of VESPO's sequence weight over the sequences with a valid token, every process."""
    import rlmath

    _, m = rlmath.compute_policy_loss_vespo(
        old.detach(), logps.detach(), adv.expand(logps.shape), mask, k_pos=self.args.vespo_k_pos,
        lambda_pos=self.args.vespo_lambda_pos, k_neg=self.args.vespo_k_neg,
        lambda_neg=self.args.vespo_lambda_neg,
        importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
    )  # fmt: skip
    rows = mask.bool().any(-1).sum().float()
    local = torch.stack([m["vespo_phi_mean"].float() * rows, rows])
    totals = self.accelerator.reduce(local, reduction="sum")
    return float((totals[0] / totals[1].clamp(min=1.0)).item())
