"""One complete GRPO update of a HuggingFace causal LM with rlmath, on a CPU in seconds.

A tiny random Qwen2 (built from a config: no download) samples 4 responses for
each of 2 prompts with ``model.generate``; a toy reward scores each response;
``rlmath.hf.response_log_probs`` gives the old, reference and current
log-probs (and entropy) without ever holding ``[B, S, V]`` logits; GRPO
advantages, the PPO-clip loss, a k3 KL to the reference and an entropy bonus
form the loss; the optimizer steps. Run: ``python examples/hf_grpo_step.py``.
"""

from __future__ import annotations

import copy
import time

import torch
import transformers

import rlmath
from rlmath.hf import response_log_probs

PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN, VOCAB = 2, 4, 6, 8, 128
TEMPERATURE, KL_COEF, ENTROPY_COEF = 0.9, 0.01, 0.001


def build_model() -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def rollout(model, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[left-padded prompt | right-padded response]`` ids and their mask (verl's layout)."""
    ids = prompts.repeat_interleave(SAMPLES, 0)
    prompt_mask = torch.ones_like(ids)
    prompt_mask[::2, :2] = 0  # some prompts are shorter: left padding
    ids = torch.where(prompt_mask.bool(), ids, 2)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=prompt_mask, max_new_tokens=RESPONSE_LEN, min_new_tokens=1,
            do_sample=True, temperature=TEMPERATURE, top_k=0, pad_token_id=2, eos_token_id=1,
        )  # fmt: skip
    response = out[:, PROMPT_LEN:]
    response = torch.nn.functional.pad(response, (0, RESPONSE_LEN - response.shape[1]), value=2)
    response_mask = rlmath.get_response_mask(response, eos_token=1)  # the first EOS is kept
    return torch.cat([ids, response], 1), torch.cat([prompt_mask, response_mask], 1)


def reward(responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Toy task: the share of response tokens below VOCAB / 4, as a last-token reward."""
    score = ((responses < VOCAB // 4) & mask.bool()).sum(-1) / mask.sum(-1).clamp_min(1)
    rewards = torch.zeros(responses.shape, dtype=torch.float32)
    last = (mask.sum(-1) - 1).clamp_min(0)
    return rewards.scatter(1, last[:, None], score[:, None].float())


def main() -> None:
    start = time.perf_counter()
    policy = build_model()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    prompts = torch.randint(
        3, VOCAB, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(1)
    )

    input_ids, attention_mask = rollout(policy, prompts)
    R = RESPONSE_LEN
    response_mask = attention_mask[:, -R:]
    with torch.no_grad():
        old_log_prob, _ = response_log_probs(
            policy, input_ids, attention_mask, R, temperature=TEMPERATURE, return_entropy=False
        )
        ref_log_prob, _ = response_log_probs(
            reference, input_ids, attention_mask, R, temperature=TEMPERATURE, return_entropy=False
        )
    token_rewards = reward(input_ids[:, -R:], response_mask)
    group = torch.arange(PROMPTS).repeat_interleave(SAMPLES)
    advantages, _ = rlmath.compute_grpo_outcome_advantage(token_rewards, response_mask, group)

    log_prob, entropy = response_log_probs(
        policy, input_ids, attention_mask, R, temperature=TEMPERATURE
    )
    pg_loss, metrics = rlmath.compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean"
    )
    kl = rlmath.kl_penalty(log_prob, ref_log_prob, "k3")
    kl_loss = rlmath.agg_loss(kl, response_mask, loss_agg_mode="token-mean")
    entropy_loss = rlmath.agg_loss(entropy, response_mask, loss_agg_mode="token-mean")
    loss = pg_loss + KL_COEF * kl_loss - ENTROPY_COEF * entropy_loss
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()

    print(
        f"responses: {response_mask.sum(-1).tolist()} tokens; mean reward {token_rewards.sum(-1).mean():.3f}"
    )
    print(
        f"loss {loss.item():.4f} (pg {pg_loss.item():.4f}, kl {kl_loss.item():.2e}, entropy {entropy_loss.item():.3f})"
    )
    print(f"pg_clipfrac {metrics['pg_clipfrac'].item():.3f}, grad norm {grad_norm.item():.3f}")
    print(f"one GRPO step in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
