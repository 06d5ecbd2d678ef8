"""Run verl 0.9.1's actor and critic workers (``TrainingWorker`` on the FSDP2 engine) on CPU.

Run by ``test_compat_verl_workers.py`` in a fresh process per side, stock or
patched by ``rlmath.compat.verl.install()``. Per ``use_remove_padding`` setting
it builds an actor and a critic ``TrainingWorker`` from a two-layer Qwen2
saved here (no hub access), then does what verl's ``RayPPOTrainer`` does for
one step, with the trainer's own data conversions
(``left_right_2_no_padding`` / ``no_padding_2_padding``): old log-probs and
entropy (``_compute_old_log_prob``), values (``_compute_values``),
``update_actor`` and ``update_critic`` (one mini-batch, one epoch), and saves
what came out, the gradients and the updated parameters.

With ``--bf16`` the engines run as verl runs them by default: fp32 master
weights, bf16 compute (FSDP's ``MixedPrecision(param_dtype=bfloat16)`` and
``torch.autocast``). The runner then also records, for each old log-prob
pass, the logits handed to the log-prob and entropy functions and what each
returned, with a float64 log-softmax of the same logits, so that the test
can separate the error of the log-softmax from that of the model's bf16
forward pass.

What running verl's workers on a CPU needs, none of which touches the math:

- a ``gloo`` process group of one rank (``RANK``/``WORLD_SIZE``/``MASTER_*``);
- a CPU platform registered through verl's ``PlatformRegistry`` (verl ships
  CUDA and NPU ones only), set before the engine modules are imported, which
  read the device name at import;
- ``VERL_ENGINE_DEVICE=cuda``: the FSDP engines are registered for
  ``device=["cuda", "npu"]`` only, and the registry looks them up by device;
- ``sdpa`` attention: the model config asks for it, and verl's value-head
  loader hard-codes ``attn_implementation="flash_attention_2"``, which this
  runner maps to ``sdpa`` (flash-attention has no CPU build);
- ``use_torch_compile=False`` (verl compiles its entropy function by default).

The engine is FSDP2 (``strategy="fsdp2"``). verl's default, ``"fsdp"`` (FSDP1),
cannot run on a CPU: verl wraps with ``sync_module_states=True``, and PyTorch's
FSDP1 then requires the parameters on an accelerator ("The module has CPU
parameters or buffers when `sync_module_states=True`").

    python -m tests.peers.verl_worker_run [--patched] [--bf16] OUT.pt
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import tempfile
import warnings
from typing import Any

B, PROMPT, RESPONSE, VOCAB = 4, 5, 6, 200
TEMPERATURE = 0.8
ENTROPY_COEFF, CLIP_HIGH, CLIP_VALUE, KL_COEF = 0.01, 0.28, 0.5, 0.1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_platform() -> None:
    """Register and select a CPU platform in verl's platform registry."""
    import types

    import torch
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    # What verl asks of the device module beyond torch.cpu: memory statistics (0 on CPU).
    module = types.SimpleNamespace(
        **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")}
    )
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated",
                 "memory_reserved"):  # fmt: skip
        setattr(module, name, lambda *a, **k: 0)
    module.reset_peak_memory_stats = lambda *a, **k: None
    module.empty_cache = lambda: None
    module.mem_get_info = lambda *a, **k: (0, 0)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: "cpu"
    module.set_device = lambda *a: None
    module.get_device_name = lambda *a: "CPU"

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            # verl moves tensors with `.to(get_device_id())`: an index means an accelerator.
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Any:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(PlatformCPU())


def _sdpa_for_flash_attention() -> None:
    """verl's value-head loader asks for flash-attention by name: load with sdpa instead."""
    from transformers import AutoModelForTokenClassification

    original = AutoModelForTokenClassification.from_pretrained.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = "sdpa"
        return original(cls, *args, **kwargs)

    AutoModelForTokenClassification.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign]


def save_model(path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)


def build_batch() -> Any:
    """Left-padded prompts, right-padded responses, as verl's rollout returns them."""
    import numpy as np
    import torch
    from verl import DataProto

    gen = torch.Generator().manual_seed(1)
    prompt_len = torch.tensor([5, 3, 4, 2])
    response_len = torch.tensor([6, 4, 2, 5])
    prompt_mask = torch.arange(PROMPT)[None, :] >= (PROMPT - prompt_len)[:, None]
    response_mask = torch.arange(RESPONSE)[None, :] < response_len[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    input_ids = torch.randint(2, VOCAB, (B, PROMPT + RESPONSE), generator=gen) * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    batch = {
        "prompts": input_ids[:, :PROMPT],
        "responses": input_ids[:, PROMPT:],
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask.long(),
    }
    data = DataProto.from_dict(
        tensors=batch,
        non_tensors={"uid": np.array([f"p{i // 2}" for i in range(B)], dtype=object)},
        meta_info={"temperature": TEMPERATURE},
    )
    extra = {
        "advantages": torch.randn(B, RESPONSE, generator=gen) * response_mask,
        "returns": torch.randn(B, RESPONSE, generator=gen) * response_mask,
        "log_prob_shift": (torch.rand(B, RESPONSE, generator=gen) - 0.5) * response_mask,
        "ref_shift": (torch.rand(B, RESPONSE, generator=gen) - 0.5) * response_mask,
    }
    return data, extra


def _workers(path: str, remove_padding: bool, bf16: bool) -> tuple[Any, Any]:
    from functools import partial

    from verl.workers.config import (
        FSDPActorConfig,
        FSDPCriticConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss, value_loss

    def model(model_type: str) -> Any:
        return HFModelConfig(
            path=path, load_tokenizer=False, use_remove_padding=remove_padding,
            enable_gradient_checkpointing=False, model_type=model_type,
            override_config={"attn_implementation": "sdpa"},
        )  # fmt: skip

    def engine() -> Any:
        # bf16: verl's default mixed precision (fp32 master weights, bf16 forward and
        # backward under autocast, fp32 gradient reduction).
        compute = "bf16" if bf16 else "fp32"
        return FSDPEngineConfig(
            strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
            mixed_precision={"param_dtype": compute, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        )  # fmt: skip

    def optim() -> Any:
        # clip_grad above the gradient norm: clipping to a fixed norm would hide a wrong loss
        # scale from the gradients (grad_norm, taken before clipping, shows it either way).
        return FSDPOptimizerConfig(lr=1e-2, clip_grad=100.0, weight_decay=0.0, lr_warmup_steps=-1)

    actor_cfg = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2,
        use_torch_compile=False, entropy_coeff=ENTROPY_COEFF, use_remove_padding=remove_padding,
        clip_ratio_low=0.2, clip_ratio_high=CLIP_HIGH, use_kl_loss=True, kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl", loss_agg_mode="token-mean",
        fsdp_config=engine(), optim=optim(),
    )  # fmt: skip
    critic_cfg = FSDPCriticConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2,
        cliprange_value=CLIP_VALUE, loss_agg_mode="token-mean", optim=optim(),
    )  # fmt: skip
    workers = []
    for model_type, loss in (
        ("language_model", partial(ppo_loss, config=actor_cfg)),
        ("value_model", partial(value_loss, config=critic_cfg)),
    ):
        eng = engine()
        eng.use_dynamic_bsz = False
        eng.micro_batch_size_per_gpu = 2
        eng.infer_micro_batch_size_per_gpu = 2
        config = TrainingWorkerConfig(
            model_type=model_type, model_config=model(model_type), engine_config=eng,
            optimizer_config=optim(), checkpoint_config=actor_cfg.checkpoint,
        )  # fmt: skip
        worker = TrainingWorker(config=config)
        worker.reset()
        worker.set_loss_fn(loss)
        workers.append(worker)
    return workers[0], workers[1]


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _capture_grads(worker: Any) -> dict[str, Any]:
    """The gradients the optimizer steps with (after verl's clipping), by parameter name."""
    names = {id(p): name for name, p in worker.engine.module.named_parameters()}
    grads: dict[str, Any] = {}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = _full(p.grad)

    worker.engine.optimizer.register_step_pre_hook(hook)
    return grads


def _params(worker: Any) -> dict[str, Any]:
    return {name: _full(p) for name, p in worker.engine.module.named_parameters()}


def _metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Each metric's value and Python type (lists of per-micro-batch values kept as lists)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            out[key] = {
                "type": f"list[{type(value[0]).__name__}]",
                "value": [float(v) for v in value],
            }
        else:
            out[key] = {"type": type(value).__name__, "value": float(value)}
    return out


class _Recorder:
    """Records the inputs and outputs of the log-prob and entropy functions while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, list[dict[str, Any]]] = {"log_probs": [], "entropy": []}

    def wrap(self, fn: Any, kind: str) -> Any:
        import functools

        import torch

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if self.on:
                logits = kwargs["logits"] if "logits" in kwargs else args[0]
                ref = torch.log_softmax(logits.detach().double(), -1)
                if kind == "log_probs":
                    labels = kwargs["labels"] if "labels" in kwargs else args[1]
                    ref = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                else:
                    ref = -(ref.exp() * ref).sum(-1)
                self.calls[kind].append(
                    {"logits": logits.detach().clone(), "out": out.detach().double(), "ref": ref}
                )
            return out

        return recorded

    def take(self) -> dict[str, list[dict[str, Any]]]:
        calls, self.calls = self.calls, {"log_probs": [], "entropy": []}
        return calls


RECORDER = _Recorder()


def one_step(path: str, remove_padding: bool, bf16: bool) -> dict[str, Any]:
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    actor, critic = _workers(path, remove_padding, bf16)
    data, extra = build_batch()
    out: dict[str, Any] = {}

    # RayPPOTrainer._compute_old_log_prob
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False
    )
    RECORDER.on = bf16
    result = actor.infer_batch(td)
    RECORDER.on = False
    out["log_softmax_calls"] = RECORDER.take()
    out["old_log_probs"] = no_padding_2_padding(tu.get(result, "log_probs"), td).float()
    out["entropys"] = no_padding_2_padding(tu.get(result, "entropy"), td).float()
    # RayPPOTrainer._compute_values
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, compute_loss=False)
    result = critic.infer_batch(td)
    out["values"] = no_padding_2_padding(tu.get(result, "values"), td).float()

    # The policy that sampled the batch is not the one being updated (a later mini-batch, an
    # asynchronous rollout): its log-probs differ by up to ~0.5 nats, so the update clips.
    behaviour = out["old_log_probs"] + extra.pop("log_prob_shift")
    # The reference policy (the KL loss's) is another one again.
    extra["ref_log_prob"] = out["old_log_probs"] + extra.pop("ref_shift")
    data = data.union(
        DataProto.from_dict(tensors={"old_log_probs": behaviour, "values": out["values"], **extra})
    )
    # RayPPOTrainer._update_actor (one mini-batch of the whole batch, one epoch, no shuffle)
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
        global_batch_size=B, mini_batch_size=B, epochs=1, seed=42,
        dataloader_kwargs={"shuffle": False}, compute_loss=True,
    )  # fmt: skip
    out["actor_params_before"] = _params(actor)
    out["actor_grads"] = _capture_grads(actor)
    out["actor_metrics"] = _metrics(tu.get(actor.train_mini_batch(td), "metrics"))
    out["actor_params"] = _params(actor)
    # RayPPOTrainer._update_critic
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td, global_batch_size=B, mini_batch_size=B, epochs=1, seed=42,
        dataloader_kwargs={"shuffle": False},
    )  # fmt: skip
    out["critic_params_before"] = _params(critic)
    out["critic_grads"] = _capture_grads(critic)
    out["critic_metrics"] = _metrics(tu.get(critic.train_mini_batch(td), "metrics"))
    out["critic_params"] = _params(critic)
    out["response_mask"] = data.batch["response_mask"].bool()
    inputs = ("advantages", "returns", "old_log_probs", "ref_log_prob")
    out["inputs"] = {k: data.batch[k].clone() for k in inputs}
    out["optimizer"] = {
        role: {k: worker.engine.optimizer.param_groups[0][k] for k in ("lr", "eps", "weight_decay")}
        for role, worker in (("actor", actor), ("critic", critic))
    }
    out["optimizer"]["name"] = type(actor.engine.optimizer).__name__
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--patched", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="verl's default bf16 mixed precision")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()), VERL_ENGINE_DEVICE="cuda", CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip

    import torch

    torch.set_num_threads(1)
    # verl would ask for "cpu:gloo,<device>:<backend>", twice cpu here: one gloo rank instead.
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    _cpu_platform()
    _sdpa_for_flash_attention()
    # Imported before install(), as in a worker whose code is loaded first: install() must
    # rebind the names verl's engine and losses took with `from ... import`.
    import verl.workers.engine_workers
    import verl.workers.utils.losses  # noqa: F401

    installed: dict[str, Any] = {}
    if opts.patched:
        import rlmath.compat.verl

        installed = rlmath.compat.verl.install()

    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.fsdp.transformer_impl as impl
    import verl.workers.utils.losses as losses

    used = {
        "engine.logprobs_from_logits": impl.logprobs_from_logits.__module__,
        "engine.entropy_from_logits": verl_F.entropy_from_logits.__module__,
        "losses.get_policy_loss_fn('vanilla')": losses.get_policy_loss_fn("vanilla").__module__,
        "losses.agg_loss": losses.agg_loss.__module__,
        "losses.compute_value_loss": losses.compute_value_loss.__module__,
        "losses.kl_penalty": losses.kl_penalty.__module__,
    }
    if opts.bf16:
        # Built after this, the engines bind these names: every call goes through the recorder.
        impl.logprobs_from_logits = RECORDER.wrap(impl.logprobs_from_logits, "log_probs")
        verl_F.entropy_from_logits = RECORDER.wrap(verl_F.entropy_from_logits, "entropy")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(tmp)
        for remove_padding in (False, True):
            torch.manual_seed(0)
            results[f"remove_padding={remove_padding}"] = one_step(tmp, remove_padding, opts.bf16)
    meta = {
        "vocab": VOCAB, "entropy_coeff": ENTROPY_COEFF, "clip_ratio_high": CLIP_HIGH,
        "cliprange_value": CLIP_VALUE, "kl_loss_coef": KL_COEF, "bf16": opts.bf16,
    }  # fmt: skip
    torch.save({"installed": sorted(installed), "used": used, "results": results, **meta}, opts.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
