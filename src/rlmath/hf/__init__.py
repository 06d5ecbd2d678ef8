"""HuggingFace ``transformers`` models: response log-probs and entropy without the logits.

Works on ``transformers`` models (rlmath's ``hf`` extra: ``pip install '.[hf]'``) without
importing ``transformers`` itself: a model is used through its own methods
(``get_output_embeddings()``, ``config``, ``forward``). See ``docs/hf.md``.
"""

from rlmath.hf.response import PACKED_ATTENTION, HeadSpec, head_of, response_log_probs

__all__ = ["PACKED_ATTENTION", "HeadSpec", "head_of", "response_log_probs"]
