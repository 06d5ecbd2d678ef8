"""HuggingFace ``transformers`` models: response log-probs and entropy without the logits.

Requires the optional ``transformers`` package (``pip install 'rlmath[hf]'``);
``import rlmath.hf`` works without it, the functions raise ``ImportError``
when called on a model without it. See ``docs/hf.md``.
"""

from rlmath.hf.response import PACKED_ATTENTION, HeadSpec, head_of, response_log_probs

__all__ = ["PACKED_ATTENTION", "HeadSpec", "head_of", "response_log_probs"]
