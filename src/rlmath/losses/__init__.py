"""Policy, value and entropy losses, loss aggregation, and rollout importance correction.

Every policy loss has the signature
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode=...,
<own scalars>, rollout_is_weights=None, global_num_tokens=None,
global_num_seqs=None, dp_size=1, norm_length=None, log_ratio_clamp=20.0)
-> (loss, metrics)`` and is registered under verl's name
(:func:`get_policy_loss`). Aggregation (:func:`agg_loss`) is exact under
data parallelism and gradient accumulation when given the global counts of
:func:`global_batch_info`. Nothing here calls ``.item()`` or synchronizes
with the device; metrics are detached 0-d tensors.
"""

from rlmath.losses.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    global_batch_info,
    prompt_batch_info,
)
from rlmath.losses.cispo import (
    compute_policy_loss_cispo,
)
from rlmath.losses.clip_cov import (
    clip_cov_selection,
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
    kl_cov_selection,
)
from rlmath.losses.dppo import (
    binary_kl,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
)
from rlmath.losses.dro import (
    compute_policy_loss_dro,
)
from rlmath.losses.entropy_loss import (
    compute_entropy_loss,
)
from rlmath.losses.geo_mean import (
    compute_policy_loss_geo_mean,
)
from rlmath.losses.gpg import (
    compute_policy_loss_gpg,
)
from rlmath.losses.gspo import (
    compute_policy_loss_gspo,
    compute_policy_loss_gspo_seq,
    sequence_log_ratio,
)
from rlmath.losses.high_entropy_mask import (
    HighEntropyMask,
    high_entropy_token_mask,
    masked_quantile,
)
from rlmath.losses.ipo import (
    compute_policy_loss_ipo,
)
from rlmath.losses.kimi15 import (
    KIMI15_PENALTY_LEVELS,
    compute_policy_loss_kimi15,
)
from rlmath.losses.luspo import (
    compute_policy_loss_luspo,
)
from rlmath.losses.off_policy_sequence_mask import (
    OffPolicySequenceMask,
    off_policy_sequence_mask,
)
from rlmath.losses.positive_example_nll import (
    compute_positive_example_nll_loss,
)
from rlmath.losses.ppo_clip import (
    compute_policy_loss_vanilla,
    ppo_clip_regions,
)
from rlmath.losses.proximal_log_prob import (
    loglinear_proximal_log_prob,
)
from rlmath.losses.registry import (
    get_policy_loss,
    list_policy_losses,
    register_policy_loss,
)
from rlmath.losses.reinforce import (
    compute_policy_loss_reinforce,
)
from rlmath.losses.rollout_correction import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    RolloutCorrection,
    rollout_correction,
    segment_labels,
)
from rlmath.losses.rollout_prob_diff import (
    ROLLOUT_PROB_DIFF_LEVELS,
    RolloutProbDiffFilter,
    rollout_prob_diff_filter,
)
from rlmath.losses.rollout_rejection import (
    ROLLOUT_REJECTION_OPTIONS,
    RolloutRejection,
    rollout_rejection,
    rollout_rejection_bounds,
    rollout_rejection_statistic,
)
from rlmath.losses.sapo import (
    compute_policy_loss_sapo,
)
from rlmath.losses.topr import (
    TOPR_RATIO_LEVELS,
    compute_policy_loss_topr,
)
from rlmath.losses.two_sided_clip import (
    compute_policy_loss_two_sided_clip,
)
from rlmath.losses.value_loss import (
    compute_value_loss,
)
from rlmath.losses.vespo import (
    compute_policy_loss_vespo,
    vespo_weight,
)

__all__ = [
    "KIMI15_PENALTY_LEVELS",
    "LOSS_AGG_MODES",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "ROLLOUT_PROB_DIFF_LEVELS",
    "ROLLOUT_REJECTION_OPTIONS",
    "TOPR_RATIO_LEVELS",
    "HighEntropyMask",
    "OffPolicySequenceMask",
    "RolloutCorrection",
    "RolloutProbDiffFilter",
    "RolloutRejection",
    "agg_loss",
    "binary_kl",
    "clip_cov_selection",
    "compute_entropy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gspo_seq",
    "compute_policy_loss_ipo",
    "compute_policy_loss_kimi15",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_luspo",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_topr",
    "compute_policy_loss_two_sided_clip",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_vespo",
    "compute_positive_example_nll_loss",
    "compute_value_loss",
    "get_policy_loss",
    "global_batch_info",
    "high_entropy_token_mask",
    "kl_cov_selection",
    "list_policy_losses",
    "loglinear_proximal_log_prob",
    "masked_quantile",
    "off_policy_sequence_mask",
    "ppo_clip_regions",
    "prompt_batch_info",
    "register_policy_loss",
    "rollout_correction",
    "rollout_prob_diff_filter",
    "rollout_rejection",
    "rollout_rejection_bounds",
    "rollout_rejection_statistic",
    "segment_labels",
    "sequence_log_ratio",
    "vespo_weight",
]
