"""rlmath: the math engine of RLHF training for PyTorch.

Every public function is importable from the top level, e.g.
``from rlmath import masked_mean, kl_penalty``. Semantics are pinned in
docs/design.md; each function's docstring states the shapes and dtypes.
"""

from rlmath import (
    advantages,
    entropy_controllers,
    fused_head,
    kl,
    kl_controllers,
    log_probs,
    losses,
    masked,
    padding,
    reward_shaping,
    rewards,
    schedules,
    tensor_utils,
)
from rlmath._version import __version__ as __version__
from rlmath.advantages import *
from rlmath.entropy_controllers import *
from rlmath.fused_head import *
from rlmath.kl import *
from rlmath.kl_controllers import *
from rlmath.log_probs import *
from rlmath.losses import *
from rlmath.masked import *
from rlmath.padding import *
from rlmath.reward_shaping import *
from rlmath.rewards import *
from rlmath.schedules import *
from rlmath.tensor_utils import *

# Written as += so that type checkers follow the re-exports.
__all__: list[str] = []
__all__ += masked.__all__
__all__ += tensor_utils.__all__
__all__ += padding.__all__
__all__ += kl.__all__
__all__ += kl_controllers.__all__
__all__ += entropy_controllers.__all__
__all__ += rewards.__all__
__all__ += reward_shaping.__all__
__all__ += schedules.__all__
__all__ += log_probs.__all__
__all__ += fused_head.__all__
__all__ += advantages.__all__
__all__ += losses.__all__
