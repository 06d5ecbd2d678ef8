"""rlmath quickstart: one small, readable call of each foundation function group.

Run from the repository root: ``.venv/bin/python examples/quickstart.py`` (after
``make test`` or ``make demo`` has created ``.venv``), or ``python examples/quickstart.py``
in any environment where rlmath is installed. It takes no arguments.
Every number printed is computed here, on a toy batch of 3 responses.
"""

import torch

import rlmath

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)


def section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 60 - len(title)))


# A toy batch: 3 responses of up to 6 tokens; token id 2 is EOS, 0 is padding.
responses = torch.tensor(
    [
        [11, 12, 13, 2, 0, 0],
        [21, 22, 2, 0, 0, 0],
        [31, 32, 33, 34, 35, 36],  # no EOS: truncated at the length limit
    ]
)

section("response mask (first EOS kept, everything after masked)")
mask = rlmath.get_response_mask(responses, eos_token=2)
print(mask)

section("padding: pack the valid tokens, then restore the batch")
packed, indices, cu_seqlens, max_seqlen, seqused = rlmath.unpad_input(responses, mask)
print("packed tokens :", packed.tolist())
print("cu_seqlens    :", cu_seqlens.tolist(), " max_seqlen:", max_seqlen)
restored = rlmath.pad_input(packed, indices, *responses.shape)
print("round trip ok :", torch.equal(restored, responses * mask))

section("per-token log-probs of the policy and the reference")
logprob = -torch.rand(3, 6) * 2
ref_logprob = logprob + 0.2 * torch.randn(3, 6)
print("log π     :", logprob[0])
print("log π_ref :", ref_logprob[0])

section("KL estimators (masked mean over valid tokens)")
print("(toy log-probs, not sampled from π, so the estimators need not agree)")
for name in ["k1", "abs", "k2", "k3", "k3+"]:
    kl = rlmath.kl_penalty(logprob, ref_logprob, name)
    print(f"{name:4s} mean KL = {rlmath.masked_mean(kl, mask):.5f}")

section("masked statistics")
scores = torch.randn(3, 6)
print("masked mean :", f"{rlmath.masked_mean(scores, mask):.4f}")
print("masked var  :", f"{rlmath.masked_var(scores, mask):.4f}")
whitened = rlmath.masked_whiten(scores, mask)
print(
    "whitened    :",
    f"mean {rlmath.masked_mean(whitened, mask):.4f}, var {rlmath.masked_var(whitened, mask):.4f}",
)

section("token rewards with an in-reward KL penalty")
controller = rlmath.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.01, horizon=1000)
token_scores = torch.zeros(3, 6)
token_scores[0, 3], token_scores[1, 2], token_scores[2, 5] = 1.0, -1.0, 0.5  # score on last token
rewards = rlmath.compute_rewards(
    token_scores, logprob, ref_logprob, controller.value, response_mask=mask
)
print(rewards)

section("adaptive KL controller (Ziegler et al. 2019)")
for step in range(3):
    current_kl = rlmath.masked_mean(rlmath.kl_penalty(logprob, ref_logprob, "k1"), mask)
    controller.update(current_kl, n_steps=64)
    print(f"step {step}: measured KL {float(current_kl):.4f} -> beta {controller.value:.5f}")

section("learning-rate schedules (multiplier of the peak lr)")
opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
sched = rlmath.get_cosine_schedule_with_warmup(
    opt, num_warmup_steps=2, num_training_steps=10, min_lr_ratio=0.1
)
seen = []
for _ in range(12):
    seen.append(opt.param_groups[0]["lr"] / 1e-6)
    opt.step()
    sched.step()
print("cosine  :", " ".join(f"{v:.2f}" for v in seen), " (held after step 10)")
wsd = [rlmath.wsd_schedule_lambda(s, num_warmup_steps=2, num_training_steps=10) for s in range(12)]
print("wsd     :", " ".join(f"{v:.2f}" for v in wsd))
const = [rlmath.constant_schedule_lambda(s, num_warmup_steps=2) for s in range(12)]
print("constant:", " ".join(f"{v:.2f}" for v in const))
