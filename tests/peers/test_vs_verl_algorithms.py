"""Differential tests against verl 0.9.1 for the algorithms added beside verl's own.

* ``kimi15`` with ``penalty_level="token"`` (ROLL's form) is verl's ``dro`` loss;
* ``rollout_correction(batch_normalize=True)`` is verl's
  ``compute_rollout_correction_weights(rollout_is_batch_normalize=True)``, for
  truncated (TIS) and IcePop weights, token and sequence levels;
* the ``chi2_token`` / ``chi2_seq`` metrics are verl's
  ``compute_offpolicy_metrics`` ones;
* ``soft_overlong_punishment`` is the overlong penalty of verl's
  ``DAPORewardManager`` for responses up to the length limit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.peers.peer_helpers import assert_close, import_verl, randn, random_mask

verl_core = import_verl("verl.trainer.ppo.core_algos")
verl_cfg = import_verl("verl.workers.config")
verl_corr = import_verl("verl.trainer.ppo.rollout_corr_helper")
verl_dapo = import_verl("verl.workers.reward_manager.dapo")
verl_proto = import_verl("verl")

import rlmath  # noqa: E402

TOL = dict(rtol=2e-5, atol=1e-6)


def _inputs(seed, b=6, t=11, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, t, gen, layout="right", p_gap=0.2)
    old = -torch.rand(b, t, generator=gen) * 3 - 0.05
    logp = (old + randn(b, t, gen=gen, scale=spread)).clamp(max=-1e-4)
    adv = randn(b, t, gen=gen)
    return old, logp, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_kimi15_token_penalty_is_verls_dro(mode):
    old, logp, adv, mask = _inputs(1)
    cfg = verl_cfg.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=verl_cfg.PolicyLossConfig(dro_beta=0.3),
    )  # fmt: skip
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, _ = rlmath.compute_policy_loss_kimi15(old, a, adv, mask, loss_agg_mode=mode, tau=0.3)
    theirs, _ = verl_core.get_policy_loss_fn("dro")(
        old, b, adv, mask.float(), loss_agg_mode=mode, config=cfg
    )
    ours.backward()
    theirs.backward()
    assert_close(ours, theirs, **TOL)
    assert_close(a.grad, b.grad, **TOL)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_batch_normalized_weights_are_verls(level, threshold):
    old, rollout, _, mask = _inputs(2, spread=0.3)
    if level == "sequence":  # short rows keep some sequence products inside the bounds
        mask[:, 4:] = False
    log_ratio = (old - rollout) * mask
    theirs, their_metrics = verl_corr.compute_rollout_correction_weights(
        log_ratio, mask.float(), rollout_is=level, rollout_is_threshold=threshold,
        rollout_is_batch_normalize=True,
    )  # fmt: skip
    icepop = isinstance(threshold, str)
    ours = rlmath.rollout_correction(
        old, rollout, mask, level=level, mode="mask" if icepop else "truncate",
        threshold_low=0.5 if icepop else None, threshold_high=2.0, batch_normalize=True,
    )  # fmt: skip
    assert_close(ours.weights, theirs, rtol=1e-6, atol=1e-7)
    assert_close(
        ours.metrics["batch_norm_factor"], their_metrics["rollout_is_batch_norm_factor"],
        rtol=1e-6, atol=0,
    )  # fmt: skip


def test_chi2_metrics_are_verls():
    old, rollout, _, mask = _inputs(3, spread=0.2)
    theirs = verl_corr.compute_offpolicy_metrics(old, rollout, mask.float())
    ours = rlmath.rollout_correction(old, rollout, mask).metrics
    for key in ("chi2_token", "chi2_seq"):
        assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)


class _Tokenizer:
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_soft_overlong_punishment_is_verls_dapo_reward_manager():
    max_len, buffer, factor = 20, 6, 0.7
    lengths = [1, 10, 14, 15, 17, 19, 20]
    b = len(lengths)
    responses = torch.ones(b, max_len, dtype=torch.long)
    response_mask = (torch.arange(max_len) < torch.tensor(lengths)[:, None]).long()
    prompts = torch.ones(b, 3, dtype=torch.long)
    data = verl_proto.DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "attention_mask": torch.cat([torch.ones(b, 3, dtype=torch.long), response_mask], 1),
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": ""}] * b, dtype=object),
            "data_source": np.array(["x"] * b, dtype=object),
        },
    )
    cfg = verl_cfg_overlong(buffer, factor)
    manager = verl_dapo.DAPORewardManager(
        tokenizer=_Tokenizer(), num_examine=0, compute_score=lambda **kw: 0.25,
        max_resp_len=max_len, overlong_buffer_cfg=cfg,
    )  # fmt: skip
    theirs = manager(data)
    scores = torch.zeros(b, max_len)
    last = torch.tensor(lengths) - 1
    scores[torch.arange(b), last] = 0.25
    ours = rlmath.soft_overlong_punishment(
        scores, response_mask.bool(), max_response_length=max_len,
        overlong_buffer_length=buffer, penalty_factor=factor,
    )  # fmt: skip
    assert_close(ours.token_level_rewards, theirs, rtol=0, atol=1e-6)


def verl_cfg_overlong(length, factor):
    from types import SimpleNamespace

    return SimpleNamespace(enable=True, len=length, penalty_factor=factor, log=False)


def test_chi2_seq_fully_masked_rows_documented_difference():
    # docs/design.md "Losses": a fully masked row is not a sequence in rlmath; verl's
    # chi2_seq averages exp(2·0) − 1 = 0 over it too, pulling the mean towards 0.
    old, rollout, _, mask = _inputs(4, spread=0.3)
    mask[2] = False
    theirs = verl_corr.compute_offpolicy_metrics(old, rollout, mask.float())["chi2_seq"]
    ours = rlmath.rollout_correction(old, rollout, mask).metrics["chi2_seq"].item()
    live = mask.any(-1)
    seq = ((old - rollout) * mask).sum(-1)[live]
    assert ours == pytest.approx((2 * seq).exp().mean().item() - 1, rel=1e-5)
    assert theirs == pytest.approx(ours * live.sum().item() / mask.shape[0], rel=1e-5)
