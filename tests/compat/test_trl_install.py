"""``rlmath.compat.trl``: install()/uninstall() without TRL, the newest TRL's arguments, the fused head.

TRL is not installed here: ``install()`` is exercised on stand-in ``trl.*``
modules of both structures (function imports, fused LM head); the real
trainers are in ``tests/peers/test_compat_trl_install.py``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import rlmath.compat._trl_install as inst
from rlmath.compat import trl as ct


def _log_softmax64(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits.double() / temperature, -1)


# ---------------------------------------------------------------------------
# The newest TRL's arguments, against float64 math.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_selective_log_softmax_temperature_row_mask_and_topk(dtype, temperature):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 6, 90, generator=g, dtype=torch.float64) * 3).to(dtype)
    index = torch.randint(0, 90, (2, 6), generator=g)
    row_mask = torch.rand(2, 6, generator=g) > 0.4
    ref = _log_softmax64(logits, temperature)
    tol = 1e-12 if dtype == torch.float64 else 4e-6

    want = ref.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    got = ct.selective_log_softmax(logits, index, temperature=temperature)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)

    got = ct.selective_log_softmax(logits, index, temperature, row_mask)
    torch.testing.assert_close(got.double(), want * row_mask, rtol=tol, atol=tol)
    assert (got[~row_mask] == 0).all()

    topk = torch.randint(0, 90, (2, 6, 3), generator=g)
    topk_mask = torch.rand(2, 6, 3, generator=g) > 0.4
    want_k = ref.gather(-1, topk)
    got_k = ct.selective_log_softmax(logits, topk, temperature=temperature, row_mask=topk_mask)
    assert got_k.shape == topk.shape
    torch.testing.assert_close(got_k.double(), want_k * topk_mask, rtol=tol, atol=tol)


def test_selective_log_softmax_and_entropy_against_float64():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 4, 70, generator=g, dtype=torch.float64) * 2).float()
    index = torch.randint(0, 70, (3, 4), generator=g)
    row_mask = torch.rand(3, 4, generator=g) > 0.3
    for temperature in (1.0, 0.8):
        ref = _log_softmax64(logits, temperature)
        want_lp = ref.gather(-1, index.unsqueeze(-1)).squeeze(-1) * row_mask
        want_h = -(ref.exp() * ref).sum(-1) * row_mask
        x = logits.clone().requires_grad_()
        lp, h = ct.selective_log_softmax_and_entropy(x, index, True, temperature, row_mask)
        torch.testing.assert_close(lp.double(), want_lp, rtol=4e-6, atol=4e-6)
        torch.testing.assert_close(h.double(), want_h, rtol=4e-6, atol=4e-6)
        (lp.sum() + h.sum()).backward()
        assert x.grad is not None and (x.grad[~row_mask] == 0).all()  # skipped rows: no gradient
        assert (x.grad[row_mask] != 0).any()
        y = logits.clone().requires_grad_()
        _, h_detached = ct.selective_log_softmax_and_entropy(y, index, False)
        assert not h_detached.requires_grad


def test_new_arguments_reject_bad_input():
    logits, index = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be positive"):
            ct.selective_log_softmax(logits, index, temperature=bad)
        with pytest.raises(ValueError, match="temperature must be positive"):
            ct.selective_log_softmax_and_entropy(logits, index, temperature=bad)
    with pytest.raises(ValueError, match="row_mask must have the shape of index"):
        ct.selective_log_softmax(logits, index, row_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"index must have shape logits.shape\[:-1\]"):
        ct.selective_log_softmax_and_entropy(logits, torch.randint(0, 10, (2, 3, 2)))
    index_before = index.clone()
    ct.selective_log_softmax(logits, index, row_mask=torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(index, index_before)  # the input is not modified


# ---------------------------------------------------------------------------
# install() / uninstall() without TRL, and on stand-in TRL modules.


def test_install_without_trl_says_how_to_proceed(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    with pytest.raises(ImportError, match=r"patches TRL.*Install TRL.*do not need TRL"):
        ct.install()
    assert not ct.is_installed()
    ct.uninstall()  # nothing installed: a no-op
    assert not ct.is_installed()


def _fake_trl(monkeypatch, **utils_attrs):
    """Stand-in ``trl``, ``trl.trainer``, ``trl.trainer.utils`` and a trainer module binding them."""
    trl = types.ModuleType("trl")
    trainer = types.ModuleType("trl.trainer")
    utils = types.ModuleType("trl.trainer.utils")
    user = types.ModuleType("trl.trainer.some_trainer")
    for name, value in utils_attrs.items():
        setattr(utils, name, value)
        setattr(user, name, value)  # the trainer's `from .utils import name`
    trl.trainer = trainer  # type: ignore[attr-defined]
    trainer.utils = utils  # type: ignore[attr-defined]
    for name, module in (("trl", trl), ("trl.trainer", trainer), ("trl.trainer.utils", utils),
                         ("trl.trainer.some_trainer", user)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    return utils, user


def _stock_selective(logits, index):
    return torch.zeros(index.shape)


def _stock_entropy(logits, chunk_size=128):
    return torch.zeros(logits.shape[:-1])


def test_install_patches_every_binding_and_uninstall_restores_exactly(monkeypatch):
    utils, user = _fake_trl(
        monkeypatch, selective_log_softmax=_stock_selective, entropy_from_logits=_stock_entropy
    )
    try:
        first = ct.install()
        assert ct.install() == first  # idempotent
        assert first == {
            "trl.trainer.some_trainer.entropy_from_logits": _stock_entropy,
            "trl.trainer.some_trainer.selective_log_softmax": _stock_selective,
            "trl.trainer.utils.entropy_from_logits": _stock_entropy,
            "trl.trainer.utils.selective_log_softmax": _stock_selective,
        }
        for module in (utils, user):
            assert module.selective_log_softmax is ct.selective_log_softmax
            assert module.entropy_from_logits is ct.entropy_from_logits
        logits, index = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
        want = torch.log_softmax(logits.double(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(user.selective_log_softmax(logits, index).double(), want)
        with pytest.raises(RuntimeError, match="does not have the structure"):
            ct.uninstall()
            ct.install(loss=True)  # no fused head: TRL's loss cannot be patched
        assert not ct.is_installed()
    finally:
        ct.uninstall()
    assert utils.selective_log_softmax is _stock_selective
    assert user.selective_log_softmax is _stock_selective
    assert user.entropy_from_logits is _stock_entropy
    assert not ct.is_installed()


def test_unrecognised_structure_raises_and_patches_nothing(monkeypatch):
    utils, _ = _fake_trl(monkeypatch, entropy_from_logits=_stock_entropy)
    with pytest.raises(RuntimeError, match="not recognised"):
        ct.install()
    assert not ct.is_installed() and utils.entropy_from_logits is _stock_entropy


def _fake_fused_trl(monkeypatch):
    def stock_add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False,
                                outputs=("log_probs",)):  # fmt: skip
        return None

    class GRPOTrainer:
        def _compute_loss(self, model, inputs):
            return "stock"

        def _get_per_token_logps_and_entropies(
            self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
            compute_entropy=False, compute_aux_loss=False, pixel_values=None,
        ):  # fmt: skip
            return None

        get_off_policy_mask = get_high_entropy_mask = _compute_loss

    utils, _ = _fake_trl(
        monkeypatch,
        selective_log_softmax=_stock_selective,
        add_fused_lm_head=stock_add_fused_lm_head,
    )
    grpo = types.ModuleType("trl.trainer.grpo_trainer")
    grpo.GRPOTrainer = GRPOTrainer  # type: ignore[attr-defined]
    grpo.add_fused_lm_head = stock_add_fused_lm_head  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trl.trainer.grpo_trainer", grpo)
    return utils, grpo, stock_add_fused_lm_head


def test_fused_structure_loss_patch_only_on_verified_releases(monkeypatch):
    utils, grpo, stock_head = _fake_fused_trl(monkeypatch)
    stock_loss = grpo.GRPOTrainer._compute_loss
    try:
        monkeypatch.setattr(inst, "_trl_version", lambda: "1.16.0")
        replaced = ct.install()
        assert grpo.GRPOTrainer._compute_loss is inst._compute_loss
        assert grpo.add_fused_lm_head is inst._add_fused_lm_head
        assert utils.add_fused_lm_head is inst._add_fused_lm_head
        assert replaced["trl.trainer.grpo_trainer.GRPOTrainer._compute_loss"] is stock_loss
        with pytest.raises(ValueError, match="another `loss`"):
            ct.install(loss=False)
        ct.uninstall()
        assert grpo.GRPOTrainer._compute_loss is stock_loss and grpo.add_fused_lm_head is stock_head

        monkeypatch.setattr(inst, "_trl_version", lambda: "9.0.0")  # a release not verified
        with pytest.warns(UserWarning, match="TRL's loss is kept"):
            ct.install()
        assert grpo.GRPOTrainer._compute_loss is stock_loss
        assert grpo.add_fused_lm_head is inst._add_fused_lm_head  # the head is still rlmath's
        ct.uninstall()
        with pytest.warns(UserWarning, match="replaced as asked"):
            ct.install(loss=True)
        assert grpo.GRPOTrainer._compute_loss is inst._compute_loss
        ct.uninstall()
        ct.install(loss=False)
        assert grpo.GRPOTrainer._compute_loss is stock_loss
    finally:
        ct.uninstall()
    assert grpo.GRPOTrainer._compute_loss is stock_loss and utils.add_fused_lm_head is stock_head


# ---------------------------------------------------------------------------
# The fused head that install() gives TRL 1.15/1.16's trainers, on a tiny Qwen2.


def _tiny_qwen2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).double()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_forward_against_the_dense_logits(monkeypatch, temperature):
    model = _tiny_qwen2()

    def refuse(*args, **kwargs):  # TRL's head must not be asked for these outputs
        raise AssertionError("handed over to TRL's head")

    monkeypatch.setitem(inst._originals, "add_fused_lm_head", refuse)
    inst._add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # left padding
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :4] = -100  # the prompt is not scored
    out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)

    dense = model(input_ids=ids, attention_mask=attention).logits  # the plain forward still works
    ref = torch.log_softmax(dense[:, :-1] / temperature, -1)
    targets = labels[:, 1:]
    valid = targets != -100
    want_lp = ref.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    want_h = -(ref.exp() * ref).sum(-1) * valid
    torch.testing.assert_close(out.log_probs, want_lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy, want_h, rtol=1e-10, atol=1e-10)
    assert torch.equal(out.label_mask, valid)
    torch.testing.assert_close(out.loss, -want_lp.sum() / valid.sum())
    items = torch.tensor(40.0, dtype=torch.float64)
    out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True,
                num_items_in_batch=items)  # fmt: skip
    torch.testing.assert_close(out.loss, -want_lp.sum() / items)


def test_fused_head_hands_other_outputs_to_trls(monkeypatch):
    model = _tiny_qwen2()
    calls = []
    monkeypatch.setitem(inst._originals, "add_fused_lm_head", lambda *a, **k: calls.append(k))
    inst._add_fused_lm_head(model, outputs=("log_probs", "is_top1"))
    assert calls and calls[0]["outputs"] == ("log_probs", "is_top1")
    model.config.logits_scaling = 2.0  # Granite's head: not covered, TRL's head is used
    inst._add_fused_lm_head(model, outputs=("log_probs",))
    assert len(calls) == 2
