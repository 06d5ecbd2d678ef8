"""fp64 references of every policy loss, written from the papers' formulas.

Each ``ref_<name>`` returns ``{(i, t): per-token loss}`` for the valid tokens,
built from 0-d tensors so that autograd gives the reference gradient. They
loop over sequences and tokens on purpose: nothing is shared with rlmath.
"""

from __future__ import annotations

import math

import torch

CLAMP = 20.0


def _log_ratio(lp, old):
    return torch.clamp(lp - old, -CLAMP, CLAMP)


def _ratio(lp, old):
    return torch.exp(_log_ratio(lp, old))


def _seq_ratio(lp, old, i, row):
    """GSPO's s_i = exp(mean of the clamped token log-ratios of sequence i)."""
    return torch.exp(sum(_log_ratio(lp[i, t], old[i, t]) for t in row) / len(row))


def _straight_through(s, lp, old, i, t):
    """sg[s_i]·π/sg[π]: value s_i, gradient s_i·∇log π (0 beyond the clamp)."""
    lr = _log_ratio(lp[i, t], old[i, t])
    return s.detach() * torch.exp(lr - lr.detach())


def _rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def _ppo_token(r, a, el, eh):
    """PPO's clipped surrogate objective (Schulman et al. 2017, eq. 7), one token."""
    return torch.minimum(r * a, torch.clamp(r, 1 - el, 1 + eh) * a)


def ref_vanilla(old, lp, adv, mask, *, clip_ratio=0.2, clip_ratio_c=3.0, **_):
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            a = adv[i, t]
            obj = _ppo_token(_ratio(lp[i, t], old[i, t]), a, clip_ratio, clip_ratio)
            if clip_ratio_c is not None and a < 0:
                obj = torch.maximum(obj, clip_ratio_c * a)  # dual clip (Ye et al. 2020)
            out[(i, t)] = -obj
    return out


def ref_gspo_sequence(old, lp, adv, mask, *, clip_ratio=0.2, **_):
    """GSPO as a per-sequence loss with the true gradient of s_i (spread over its tokens)."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        s = _seq_ratio(lp, old, i, row)
        a_hat = sum(adv[i, t] for t in row) / len(row)
        seq_loss = -torch.minimum(s * a_hat, torch.clamp(s, 1 - clip_ratio, 1 + clip_ratio) * a_hat)
        for t in row:
            out[(i, t)] = seq_loss
    return out


def ref_gspo_seq(old, lp, adv, mask, *, clip_ratio=0.2, **_):
    """GSPO written per token with s_{i,t} = sg[s_i]·π/sg[π] and the sequence advantage."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        s = _seq_ratio(lp, old, i, row)
        a_hat = sum(adv[i, t] for t in row) / len(row)
        for t in row:
            s_t = _straight_through(s, lp, old, i, t)
            out[(i, t)] = -_ppo_token(s_t, a_hat, clip_ratio, clip_ratio)
    return out


def ref_gspo_token(old, lp, adv, mask, *, clip_ratio=0.2, **_):
    out = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        s = _seq_ratio(lp, old, i, row)
        for t in row:
            s_t = _straight_through(s, lp, old, i, t)
            out[(i, t)] = -_ppo_token(s_t, adv[i, t], clip_ratio, clip_ratio)
    return out


def ref_sapo(old, lp, adv, mask, *, tau_pos=1.0, tau_neg=1.05, **_):
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            a = adv[i, t]
            tau = tau_pos if a > 0 else tau_neg
            gate = torch.sigmoid(tau * (_ratio(lp[i, t], old[i, t]) - 1)) * 4 / tau
            out[(i, t)] = -gate * a
    return out


def ref_gpg(old, lp, adv, mask, **_):
    return {(i, t): -adv[i, t] * lp[i, t] for i, row in enumerate(_rows(mask)) for t in row}


ref_reinforce = ref_gpg


def ref_dro(old, lp, adv, mask, *, dro_beta, **_):
    return {
        (i, t): -(adv[i, t] * lp[i, t] - 0.5 * dro_beta * (lp[i, t] - old[i, t]) ** 2)
        for i, row in enumerate(_rows(mask))
        for t in row
    }


def ref_cispo(old, lp, adv, mask, *, clip_ratio=0.2, upper_only=False, **_):
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            r = _ratio(lp[i, t], old[i, t]).detach()
            w = (
                torch.clamp(r, max=1 + clip_ratio)
                if upper_only
                else torch.clamp(r, 1 - clip_ratio, 1 + clip_ratio)
            )
            out[(i, t)] = -w * adv[i, t] * lp[i, t]
    return out


def ref_geo_mean(old, lp, adv, mask, *, clip_ratio=0.2, weights=None, **_):
    out = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        logs = []
        for t in row:
            x = torch.clamp(lp[i, t] - old[i, t], -CLAMP, CLAMP)
            sgn = float(torch.sign(adv[i, t]))
            logs.append(sgn * torch.minimum(sgn * x, sgn * torch.clamp(x, -clip_ratio, clip_ratio)))
        a_hat = sum(adv[i, t] for t in row) / len(row)
        seq_loss = -a_hat * torch.exp(sum(logs) / len(logs))
        if weights is not None:
            seq_loss = seq_loss * math.exp(
                sum(math.log(float(weights[i, t]) + 1e-10) for t in row) / len(row)
            )
        for t in row:
            out[(i, t)] = seq_loss
    return out


def _dppo(old, lp, adv, mask, clip_ratio, clip_ratio_c, inside):
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            a = float(adv[i, t])
            p, p_old = math.exp(float(lp[i, t].detach())), math.exp(float(old[i, t]))
            keep = inside(p, p_old, a, clip_ratio)
            r = _ratio(lp[i, t], old[i, t]).detach()
            out[(i, t)] = -adv[i, t] * torch.clamp(r, max=clip_ratio_c) * lp[i, t] * float(keep)
    return out


def ref_dppo_tv(old, lp, adv, mask, *, clip_ratio=0.2, clip_ratio_c=3.0, **_):
    def inside(p, p_old, a, d):
        return p - p_old <= d if a > 0 else p - p_old >= -d

    return _dppo(old, lp, adv, mask, clip_ratio, clip_ratio_c, inside)


def bernoulli_kl(p_old: float, p: float) -> float:
    kl = p_old * math.log(p_old / p)
    if p_old < 1:
        kl += (1 - p_old) * math.log((1 - p_old) / (1 - p))
    return kl


def ref_dppo_kl(old, lp, adv, mask, *, clip_ratio=0.2, clip_ratio_c=3.0, **_):
    def inside(p, p_old, a, d):
        kl = bernoulli_kl(p_old, p)
        return (kl <= d or p <= p_old) if a > 0 else (kl <= d or p >= p_old)

    return _dppo(old, lp, adv, mask, clip_ratio, clip_ratio_c, inside)


def ref_clip_cov(old, lp, adv, mask, *, selection, clip_ratio=0.2, **_):
    out = ref_vanilla(old, lp, adv, mask, clip_ratio=clip_ratio, clip_ratio_c=None)
    for (i, t), v in out.items():
        if selection[i, t]:
            out[(i, t)] = v * 0
    return out


def ref_kl_cov(old, lp, adv, mask, *, selection, ppo_kl_coef=0.1, **_):
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            v = -adv[i, t] * _ratio(lp[i, t], old[i, t])
            if selection[i, t]:
                v = v + ppo_kl_coef * torch.abs(lp[i, t] - old[i, t])
            out[(i, t)] = v
    return out


def ref_covariance(adv, lp, mask):
    """cov_t = (A_t − mean A)(log π_t − mean log π) over the valid tokens, as a dict."""
    cells = [(i, t) for i, row in enumerate(_rows(mask)) for t in row]
    ma = sum(float(adv[c]) for c in cells) / len(cells)
    ml = sum(float(lp[c]) for c in cells) / len(cells)
    return {c: (float(adv[c]) - ma) * (float(lp[c]) - ml) for c in cells}


def ref_vespo(old, lp, adv, mask, *, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, **_):
    """VESPO: -φ(w_i)·A·log π with the detached sequence weight w_i = Π_t r_{i,t} (clamped)."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        log_w = sum(float(_log_ratio(lp[i, t], old[i, t]).detach()) for t in row)
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        for t in row:
            a = adv[i, t]
            k, lam = (k_pos, lambda_pos) if a >= 0 else (k_neg, lambda_neg)
            lam = max(lam, 1e-4)
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            out[(i, t)] = -phi * a * lp[i, t]
    return out


def ref_two_sided_clip(old, lp, adv, mask, *, clip_ratio=0.2, delta=4.0, **_):
    """INTELLECT-2 (§4.1): −min(min(r, δ)·A, clip(r, 1 − ε, 1 + ε)·A)."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            r, a = _ratio(lp[i, t], old[i, t]), adv[i, t]
            capped = torch.clamp(r, max=delta)
            out[(i, t)] = -torch.minimum(
                capped * a, torch.clamp(r, 1 - clip_ratio, 1 + clip_ratio) * a
            )
    return out


def ref_topr(
    old, lp, adv, mask, *, ratio_level="sequence", positive_weight=1.0, negative_weight=1.0, **_
):
    """TOPR (eq. 8): −A·log π for A ≥ 0, −[π/μ]_0^1·A·log π for A < 0 (trajectory ratio)."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        seq = sum(float(_log_ratio(lp[i, t], old[i, t]).detach()) for t in row)
        for t in row:
            a = adv[i, t]
            if a >= 0:
                out[(i, t)] = -positive_weight * a * lp[i, t]
                continue
            token = float(_log_ratio(lp[i, t], old[i, t]).detach())
            log_rho = seq if ratio_level == "sequence" else token
            out[(i, t)] = -negative_weight * min(math.exp(min(log_rho, 0.0)), 1.0) * a * lp[i, t]
    return out


def ref_kimi15(old, lp, adv, mask, *, tau=0.1, penalty_level="token", **_):
    """Kimi k1.5 (eq. 3): −A·log π plus (τ/2)·(log-ratio)², per token or of the sequence sum S.

    The sequence form spreads (τ/2)·S² over the tokens as (τ/2)·S·log r_t, each token
    carrying the gradient τ·S·∇log r_t (the derivative of (τ/2)·S² in log π_t).
    """
    out = {}
    for i, row in enumerate(_rows(mask)):
        s = sum((lp[i, t] - old[i, t]).detach() for t in row)
        for t in row:
            lr = lp[i, t] - old[i, t]
            if penalty_level == "token":
                pen = 0.5 * tau * lr**2
            else:
                pen = 0.5 * tau * s * lr + 0.5 * tau * s * (lr - lr.detach())
            out[(i, t)] = -adv[i, t] * lp[i, t] + pen
    return out


def ref_kimi15_sequence_loss(old, lp, adv, mask, *, tau=0.1):
    """Kimi k1.5's per-sample loss −Σ_t A·log π_t + (τ/2)·(Σ_t log r_t)², on the first token."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        s = sum(lp[i, t] - old[i, t] for t in row)
        for t in row:
            out[(i, t)] = -adv[i, t] * lp[i, t]
        out[(i, row[0])] = out[(i, row[0])] + 0.5 * tau * s**2
    return out


def ref_ipo(old, lp, adv, mask, *, ipo_threshold=0.1, adv_tau=1.0, kl_tau=1e-3, **_):
    """prime-rl's ipo: −[|π − π_old| ≤ thr]·adv_tau·A·r + kl_tau·(log r)²."""
    out = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            p, p_old = math.exp(float(lp[i, t].detach())), math.exp(float(old[i, t]))
            keep = float(abs(p - p_old) <= ipo_threshold)
            r = _ratio(lp[i, t], old[i, t])
            out[(i, t)] = -keep * adv_tau * adv[i, t] * r + kl_tau * (lp[i, t] - old[i, t]) ** 2
    return out


REFERENCES = {
    "vanilla": ref_vanilla,
    "gspo": ref_gspo_token,
    "gspo_token": ref_gspo_token,
    "gspo_seq": ref_gspo_seq,
    "sapo": ref_sapo,
    "gpg": ref_gpg,
    "reinforce": ref_reinforce,
    "dro": ref_dro,
    "cispo": ref_cispo,
    "geo_mean": ref_geo_mean,
    "dppo_tv": ref_dppo_tv,
    "dppo_kl": ref_dppo_kl,
    "clip_cov": ref_clip_cov,
    "kl_cov": ref_kl_cov,
    "vespo": ref_vespo,
    "two_sided_clip": ref_two_sided_clip,
    # LUSPO's per-token loss is GSPO's; its length weighting is its aggregation.
    "luspo": ref_gspo_token,
    "topr": ref_topr,
    "kimi15": ref_kimi15,
    "ipo": ref_ipo,
}
