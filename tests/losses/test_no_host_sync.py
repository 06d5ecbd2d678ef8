"""Nothing in the loss path reads a tensor back to the host.

On CPU a host sync cannot be observed, so every Python-level way of turning
tensor data into host values is made to raise while the functions run
(``tests/host_sync.py``). On CUDA the same calls also run under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch

from rlmath import (
    agg_loss,
    clip_cov_selection,
    compute_entropy_loss,
    compute_value_loss,
    get_policy_loss,
    global_batch_info,
    kl_cov_selection,
    list_policy_losses,
    prompt_batch_info,
    rollout_correction,
)

from ..host_sync import HostSync, forbid_host_reads
from .helpers import LOSS_KWARGS, MODES, policy_batch


def test_the_guard_catches_syncs():
    x = torch.ones(3)
    with forbid_host_reads():
        for bad in (
            lambda: x.sum().item(),
            lambda: bool(x.any()),
            lambda: x[x > 0],
            lambda: float(x[0]),
            lambda: torch.unique(x),
            lambda: x.unique(return_inverse=True),
        ):
            with pytest.raises(HostSync):
                bad()
    assert x.sum().item() == 3.0  # restored


def _calls(device):
    old, logp, adv, mask = (t.to(device) for t in policy_batch(4, 6, 1, dtype=torch.float32))
    info = global_batch_info(mask)
    prompts = prompt_batch_info(mask, torch.arange(4, device=device) // 2)
    gen = torch.Generator(device=device).manual_seed(0)
    for name in list_policy_losses():
        kw = dict(LOSS_KWARGS[name])
        if name in ("clip_cov", "kl_cov"):
            kw["generator"] = gen
        for mode in MODES:
            yield lambda name=name, mode=mode, kw=kw: get_policy_loss(name)(
                old, logp.clone().requires_grad_(), adv, mask, loss_agg_mode=mode,
                norm_length=6, dp_size=2, rollout_is_weights=torch.ones_like(old),
                global_num_tokens=info["global_num_tokens"],
                global_num_seqs=info["global_num_seqs"], **prompts, **kw,
            )[0].backward()  # fmt: skip
    yield lambda: clip_cov_selection(old, logp, adv, mask, clip_cov_ratio=0.3, generator=gen)
    yield lambda: kl_cov_selection(old, logp, adv, mask, kl_cov_ratio=0.3, generator=gen)
    yield lambda: kl_cov_selection(old, logp, adv, mask, kl_cov_ratio=0.3)
    for mode in MODES:
        yield lambda mode=mode: agg_loss(logp, mask, loss_agg_mode=mode, norm_length=6, **prompts)
        yield lambda mode=mode: compute_value_loss(
            logp.clone().requires_grad_(),
            adv,
            old,
            mask,
            cliprange_value=0.2,
            loss_agg_mode=mode,
            norm_length=6,
            **prompts,
        )[0].backward()
        yield lambda mode=mode: compute_entropy_loss(
            torch.randn(4, 6, 9, device=device, requires_grad=True),
            mask,
            loss_agg_mode=mode,
            norm_length=6,
            **prompts,
        )[0].backward()
    for level in ("token", "sequence", "geometric", "segment"):
        for mode in ("truncate", "mask"):
            yield lambda level=level, mode=mode: rollout_correction(
                old, logp, mask, level=level, mode=mode, batch_normalize=True
            )
    yield lambda: global_batch_info([mask, mask[:2]])


def test_no_host_reads_on_cpu():
    calls = list(_calls("cpu"))
    with forbid_host_reads():
        for call in calls:
            call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_on_cuda():
    calls = list(_calls("cuda"))
    for call in calls[:3]:  # warm-up: first-time allocations are not what is checked
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
