"""``rlmath demo``: PPO and GRPO on a tiny language model, on CPU, in a few minutes.

The demo is application code that shows how a trainer uses rlmath: every piece
of RL math (packed log-probs, entropy, KL, GAE, GRPO advantages, policy and
value losses, loss aggregation, LR schedule, masked statistics) is a call into
rlmath; the demo itself only holds the model, the task, sampling, batching and
bookkeeping. Run it with ``rlmath demo --algo grpo`` (see ``docs/demo.md``).
"""

from rlmath.demo.config import DemoConfig

__all__ = ["DemoConfig"]
