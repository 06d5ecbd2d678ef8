"""Drop-in faces of rlmath for code written against verl and TRL.

* :mod:`rlmath.compat.verl`: verl 0.9.1's math functions with verl's exact
  signatures (``config`` objects included), return structures and metric
  keys, computed by rlmath; ``install()`` puts them into a running verl.
* :mod:`rlmath.compat.trl`: TRL's ``selective_log_softmax`` and
  ``entropy_from_logits`` signatures, and a ``grpo_loss`` for TRL's
  ``loss_type`` values.

Neither imports its peer: both work (and are tested) without verl or TRL
installed. rlmath's own API (pure functions, keyword scalars) is unchanged;
see ``docs/migration.md``.
"""

from rlmath.compat._config import config_get

__all__ = ["config_get"]
