"""bf16 error of TRL's log-probs and entropies, stock and under ``rlmath.compat.trl.install()``.

Needs TRL (run it in ``.venv-peers-trl-new``, see ``tests/peers/README.md``)::

    .venv-peers-trl-new/bin/python benchmarks/trl_bf16_error.py [--tokens 1024 --hidden 1024 --vocab 32000]

Two paths, each against a float64 reference computed from the *same*
bf16-rounded inputs (so only the computation's own error is measured):

* dense logits (TRL 0.24 to 1.15: ``selective_log_softmax`` /
  ``entropy_from_logits`` on the model's bf16 logits): TRL's functions
  against rlmath.compat.trl's;
* the fused LM head (TRL 1.16: ``model(..., fused_lm_head=True)`` from bf16
  hidden states and a bf16 head): TRL's ``add_fused_lm_head`` against the
  one ``install()`` puts in its place.

Hidden states are N(0, 1) (a final RMSNorm's output scale), head weights
N(0, (3/sqrt(H))^2) (logits of standard deviation ~3), labels sampled from the
model's own distribution, as a policy's completions are. Prints max and mean
absolute errors in nats.
"""

from __future__ import annotations

import argparse
import os
import platform
import types

import torch


def _errors(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.double() - want).abs()
    return f"max {diff.max().item():.2e}  mean {diff.mean().item():.2e}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    opts = parser.parse_args()
    import trl
    import trl.trainer.utils as U

    import rlmath.compat._trl_install as inst
    from rlmath.compat import trl as ct

    torch.manual_seed(0)
    n, h, v = opts.tokens, opts.hidden, opts.vocab
    hidden = torch.randn(1, n + 1, h).bfloat16()
    weight = (torch.randn(v, h) * 3 / h**0.5).bfloat16()
    logits64 = hidden[0, :n].double() @ weight.double().T
    labels = torch.multinomial(torch.softmax(logits64, -1).float(), 1).squeeze(-1)
    ref = torch.log_softmax(logits64, -1)
    want_lp = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    want_h = -(ref.exp() * ref).sum(-1)
    print(f"TRL {trl.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; N={n} H={h} V={v}")  # fmt: skip

    # Dense bf16 logits (the model's lm_head output in bf16).
    logits = (hidden[0, :n] @ weight.T).unsqueeze(0)
    dense_ref = torch.log_softmax(logits.double(), -1)
    dense_lp = dense_ref.gather(-1, labels.view(1, n, 1)).squeeze(-1)
    dense_h = -(dense_ref.exp() * dense_ref).sum(-1)
    print("dense bf16 logits vs float64 of the same bf16 logits:")
    print(
        "  TRL    log-prob", _errors(U.selective_log_softmax(logits, labels.view(1, n)), dense_lp)
    )
    print(
        "  rlmath log-prob", _errors(ct.selective_log_softmax(logits, labels.view(1, n)), dense_lp)
    )
    print("  TRL    entropy ", _errors(U.entropy_from_logits(logits), dense_h))
    print("  rlmath entropy ", _errors(ct.entropy_from_logits(logits), dense_h))
    print("  (bf16 logits themselves vs float64 of the bf16 inputs:",
          _errors(torch.log_softmax(logits.double(), -1).gather(-1, labels.view(1, n, 1)).squeeze(-1),
                  want_lp.view(1, n)) + ")")  # fmt: skip

    if not hasattr(U, "add_fused_lm_head"):
        return

    # The fused head, on a stand-in causal LM whose backbone returns the fixed hidden states.
    class Backbone(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return types.SimpleNamespace(last_hidden_state=hidden)

    class LM(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.model = Backbone()
            self.lm_head = torch.nn.Linear(h, v, bias=False, dtype=torch.bfloat16)
            self.lm_head.weight.data.copy_(weight)
            self.config = types.SimpleNamespace(get_text_config=lambda: self.config)

        @property
        def base_model(self) -> torch.nn.Module:
            return self.model

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return self.lm_head(self.model().last_hidden_state)

    ids = torch.cat([labels.new_zeros(1), labels]).unsqueeze(0)
    inst._originals["add_fused_lm_head"] = U.add_fused_lm_head
    for name, add in (("TRL   ", U.add_fused_lm_head), ("rlmath", inst._add_fused_lm_head)):
        model = LM()
        add(model, outputs=("log_probs", "entropy"))
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        print(f"fused head ({name.strip()}) vs float64 of the same bf16 hidden states and head:")
        print(f"  {name} log-prob", _errors(out.log_probs[0], want_lp))
        print(f"  {name} entropy ", _errors(out.entropy[0], want_h))


if __name__ == "__main__":
    main()
