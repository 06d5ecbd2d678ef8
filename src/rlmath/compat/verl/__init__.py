"""verl 0.9.1's math API, computed by rlmath: the one-line migration.

::

    import rlmath.compat.verl
    rlmath.compat.verl.install()      # before anything takes `from verl... import fn`

    # or call the functions directly, verl installed or not:
    from rlmath.compat.verl import compute_policy_loss_vanilla, agg_loss
    loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages,
                                                response_mask, "token-mean", actor_config)

Every function has the signature of verl's function of the same name in
``verl.utils.torch_functional`` (:mod:`.torch_functional`),
``verl.trainer.ppo.core_algos`` (:mod:`.core_algos`) or
``verl.trainer.ppo.rollout_corr_helper`` (:mod:`.rollout_corr_helper`),
verl's return structure and metric keys; ``config`` is a verl dataclass, a
dict or an OmegaConf ``DictConfig``. Metric values have verl's types (Python
floats where verl returns floats: read back together, a host sync, where verl
syncs per value; rlmath's own functions return 0-d tensors and never read values back). The
numbers are rlmath's: ``docs/migration.md`` lists where they differ from
verl's and why. verl is never imported by this package until
:func:`install` is called.
"""

from rlmath.compat.verl import core_algos, rollout_corr_helper, torch_functional
from rlmath.compat.verl._install import VERL_VERSION, install, is_installed, uninstall
from rlmath.compat.verl.core_algos import *
from rlmath.compat.verl.rollout_corr_helper import *
from rlmath.compat.verl.torch_functional import *

__all__: list[str] = ["VERL_VERSION", "install", "is_installed", "uninstall"]
__all__ += torch_functional.__all__
__all__ += core_algos.__all__
__all__ += rollout_corr_helper.__all__
