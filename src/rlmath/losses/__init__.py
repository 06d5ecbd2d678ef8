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

from rlmath.losses import (
    aggregation,
    cispo,
    clip_cov,
    dppo,
    dro,
    entropy_loss,
    geo_mean,
    gpg,
    gspo,
    ppo_clip,
    registry,
    reinforce,
    rollout_is,
    sapo,
    value_loss,
)
from rlmath.losses.aggregation import *
from rlmath.losses.cispo import *
from rlmath.losses.clip_cov import *
from rlmath.losses.dppo import *
from rlmath.losses.dro import *
from rlmath.losses.entropy_loss import *
from rlmath.losses.geo_mean import *
from rlmath.losses.gpg import *
from rlmath.losses.gspo import *
from rlmath.losses.ppo_clip import *
from rlmath.losses.registry import *
from rlmath.losses.reinforce import *
from rlmath.losses.rollout_is import *
from rlmath.losses.sapo import *
from rlmath.losses.value_loss import *

__all__ = [
    *aggregation.__all__,
    *cispo.__all__,
    *clip_cov.__all__,
    *dppo.__all__,
    *dro.__all__,
    *entropy_loss.__all__,
    *geo_mean.__all__,
    *gpg.__all__,
    *gspo.__all__,
    *ppo_clip.__all__,
    *registry.__all__,
    *reinforce.__all__,
    *rollout_is.__all__,
    *sapo.__all__,
    *value_loss.__all__,
]
