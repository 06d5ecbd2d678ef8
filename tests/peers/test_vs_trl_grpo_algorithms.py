"""Differential tests against TRL's ``GRPOTrainer`` loss and rewards (TRL 0.24 and later).

TRL's GRPO loss is a trainer method: ``GRPOTrainer._compute_loss`` is driven
here with a stand-in ``self`` that holds only the attributes the method reads
(the loss knobs, an identity accelerator of one process) and whose
``_get_per_token_logps_and_entropies`` returns given tensors, so the
comparison covers TRL's own code path, loss value and gradient. Each test
runs the features the installed TRL has and skips the others:

* INTELLECT-2's two-sided clip (``delta``) ↔ ``two_sided_clip``;
* the top-ρ entropy mask (``top_entropy_quantile``) ↔ ``high_entropy_token_mask``;
* ``loss_type="luspo"`` (TRL >= 0.28) ↔ ``luspo``;
* off-policy sequence masking (``off_policy_mask_threshold``, TRL >= 0.27)
  ↔ ``off_policy_sequence_mask``;
* adaptive entropy control (``use_adaptive_entropy``, TRL >= 1.8)
  ↔ ``AdaptiveEntropyController``;

(``trl.rewards.get_soft_overlong_punishment`` is compared in
``test_vs_trl_rewards.py``, which does not need ``datasets``.)

Compared against TRL 0.24.0 (``.venv-peers``) and TRL 1.16.0.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from tests.peers.peer_helpers import SKIP_TRL, assert_close, random_mask

trl = pytest.importorskip("trl", reason=SKIP_TRL)
pytest.importorskip("datasets", reason="trl.trainer.grpo_trainer imports datasets")


def _import_grpo_trainer():
    # TRL 0.24 reads transformers' ``_is_package_available`` as a bool; transformers 5
    # returns ``(available, version)``, a truthy tuple, so TRL would import every
    # optional package (mergekit, vllm, ...). Read the flag the tuple holds.
    import trl.import_utils as flags

    for key, value in vars(flags).items():
        if key.startswith("_") and key.endswith("_available") and isinstance(value, tuple):
            setattr(flags, key, value[0])
    from trl.trainer.grpo_trainer import GRPOTrainer

    return GRPOTrainer


GRPOTrainer = _import_grpo_trainer()
SOURCE = inspect.getsource(GRPOTrainer._compute_loss)

import rlmath  # noqa: E402

B, T = 6, 9


class _Accelerator:
    """One process: every collective is the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trainer(**overrides):
    args = SimpleNamespace(
        delta=None, use_bias_correction_kl=False, sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
        vespo_lambda_neg=2.0, entropy_target=0.2, entropy_coef_delta=0.005,
        entropy_coef_min=0.0, entropy_coef_max=1.0, steps_per_generation=1,
    )  # fmt: skip
    fake = SimpleNamespace(
        loss_type="bnpo", importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2,
        beta=0.0, top_entropy_quantile=1.0, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=T, accelerator=_Accelerator(),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, args=args,
        off_policy_mask_threshold=None, use_liger_kernel=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, use_adaptive_entropy=False, entropy_coef=0.0,
        _last_world_entropy=math.inf, _entropy_window_stats=None,
    )  # fmt: skip
    for key, value in overrides.items():
        if key in vars(args):
            setattr(args, key, value)
        else:
            setattr(fake, key, value)
    fake.get_high_entropy_mask = partial(GRPOTrainer.get_high_entropy_mask, fake)
    for name in ("get_off_policy_mask", "get_gamma_weights"):
        if hasattr(GRPOTrainer, name):
            setattr(fake, name, getattr(GRPOTrainer, name))
    return fake


def _trl_loss(fake, log_prob, entropies, mask, advantages, old, **extra_inputs):
    """TRL's loss and its gradient w.r.t. the per-token log-probs."""
    leaf = log_prob.clone().requires_grad_()
    with_aux = "aux_loss = self._get_per_token_logps_and_entropies" in SOURCE

    def logps_and_entropies(*args, **kwargs):
        return (leaf, entropies, None) if with_aux else (leaf, entropies)

    fake._get_per_token_logps_and_entropies = logps_and_entropies
    inputs = {
        "prompt_ids": torch.zeros(B, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
        **extra_inputs,
    }
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def _ours(fn, log_prob, *args, **kwargs):
    leaf = log_prob.clone().requires_grad_()
    loss, metrics = fn(args[0], leaf, *args[1:], **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def _batch(seed, spread=0.5, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(B, T, gen, layout="right", p_gap=0.0)
    old = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3).to(dtype)
    log_prob = old.double() + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    advantages = torch.randn(B, generator=gen, dtype=torch.float64).to(dtype)
    entropies = (torch.rand(B, T, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return log_prob.clamp(max=-1e-3).to(dtype), old, advantages, mask, entropies


TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_two_sided_clip_is_trls_delta(loss_type):
    log_prob, old, adv, mask, ent = _batch(1, spread=0.8)
    fake = _trainer(loss_type=loss_type, delta=1.5)
    want, want_grad = _trl_loss(fake, log_prob, ent, mask, adv, old)
    adv_tokens = adv[:, None].expand(B, T)
    got, grad, _ = _ours(rlmath.compute_policy_loss_two_sided_clip, log_prob, old, adv_tokens,
                         mask, delta=1.5)  # fmt: skip
    assert_close(got, want, **TOL)
    assert_close(grad, want_grad, **TOL)


def test_top_entropy_mask_is_trls():
    log_prob, old, adv, mask, ent = _batch(2)
    fake = _trainer(top_entropy_quantile=0.2)
    trl_mask = fake.get_high_entropy_mask(ent, mask.long(), 1 - 0.2)
    ours = rlmath.high_entropy_token_mask(ent, mask, top_entropy_quantile=0.2)
    assert torch.equal(ours.keep, trl_mask)
    # The loss TRL trains with: the masked per-token loss over the unchanged token count.
    want, want_grad = _trl_loss(fake, log_prob, ent, mask, adv, old)
    got, grad, _ = _ours(rlmath.compute_policy_loss_vanilla, log_prob, old, adv[:, None].expand(B, T),
                         mask, clip_ratio_c=None, rollout_is_weights=ours.keep.float())  # fmt: skip
    assert_close(got, want, **TOL)
    assert_close(grad, want_grad, **TOL)


@pytest.mark.skipif('"luspo"' not in SOURCE, reason="this TRL has no loss_type='luspo' (>= 0.28)")
def test_luspo_is_trls():
    log_prob, old, adv, mask, ent = _batch(3, spread=0.3)
    fake = _trainer(loss_type="luspo", importance_sampling_level="sequence")
    want, want_grad = _trl_loss(fake, log_prob, ent, mask, adv, old)
    got, grad, _ = _ours(rlmath.compute_policy_loss_luspo, log_prob, old, adv[:, None].expand(B, T),
                         mask)  # fmt: skip
    assert_close(got, want, **TOL)
    assert_close(grad, want_grad, **TOL)


HAS_OPSM = hasattr(GRPOTrainer, "get_off_policy_mask")


@pytest.mark.skipif(not HAS_OPSM, reason="this TRL has no off-policy sequence masking (>= 0.27)")
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.2])
def test_off_policy_sequence_mask_is_trls(threshold):
    log_prob, old, adv, mask, ent = _batch(4, spread=0.4)
    gen = torch.Generator().manual_seed(5)
    sampling = old + torch.randn(B, T, generator=gen) * 0.3
    trl_keep = GRPOTrainer.get_off_policy_mask(
        advantages=adv[:, None], per_token_logps=log_prob, sampling_per_token_logps=sampling,
        mask=mask.long(), off_policy_threshold=threshold,
    )  # fmt: skip
    ours = rlmath.off_policy_sequence_mask(
        sampling, log_prob, adv[:, None], mask, threshold=threshold
    )
    assert torch.equal(ours.keep, mask & trl_keep.bool())
    # TRL's loss: the per-token loss times the mask, over the unchanged token count.
    fake = _trainer(loss_type="dapo", off_policy_mask_threshold=threshold)
    want, want_grad = _trl_loss(fake, log_prob, ent, mask, adv, old,
                                sampling_per_token_logps=sampling)  # fmt: skip
    got, grad, _ = _ours(rlmath.compute_policy_loss_vanilla, log_prob, old, adv[:, None].expand(B, T),
                         mask, clip_ratio_c=None, rollout_is_weights=ours.keep.float())  # fmt: skip
    assert_close(got, want, **TOL)
    assert_close(grad, want_grad, **TOL)


@pytest.mark.skipif(
    "use_adaptive_entropy" not in SOURCE, reason="this TRL has no adaptive entropy (>= 1.8)"
)
def test_adaptive_entropy_controller_is_trls():
    log_prob, old, adv, mask, _ = _batch(6)
    fake = _trainer(use_adaptive_entropy=True, _entropy_bonus_enabled=True, entropy_coef=0.02,
                    entropy_target=1.0, entropy_coef_delta=0.01, entropy_coef_max=0.04)  # fmt: skip
    ctl = rlmath.AdaptiveEntropyController(0.02, 1.0, delta=0.01, max_coef=0.04)
    for step, level in enumerate([1.5, 0.8, 0.9, 0.5, 2.0, 2.5, 0.2, 1.0, 3.0]):
        entropies = torch.full((B, T), level)
        applied_by_us = ctl.value
        loss, _ = _trl_loss(fake, log_prob, entropies, mask, adv, old)
        policy = fake._metrics["train"]["policy_loss"][-1]
        # TRL's loss is policy − coef·(mean entropy); recover the coefficient it applied.
        applied_by_trl = (policy - loss.item()) / level
        assert applied_by_trl == pytest.approx(applied_by_us, abs=1e-6), step
        ctl.update(level)
        assert fake.entropy_coef == pytest.approx(ctl.coef, abs=1e-12), step
        assert fake._last_world_entropy == pytest.approx(ctl.last_entropy), step


def test_compat_trl_names_are_trls():
    from rlmath.compat import trl as ct

    log_prob, _, adv, mask, ent = _batch(7)
    fake = _trainer()
    for level in (0.0, 0.5, 0.8):
        assert torch.equal(
            ct.get_high_entropy_mask(ent, mask.long(), level),
            fake.get_high_entropy_mask(ent, mask.long(), level),
        )
    if HAS_OPSM:
        args = (adv[:, None], log_prob, log_prob + 0.3, mask.long())
        for threshold in (0.1, 0.3, 0.5):
            theirs = GRPOTrainer.get_off_policy_mask(*args, threshold)
            assert torch.equal(ct.get_off_policy_mask(*args, threshold), theirs)
