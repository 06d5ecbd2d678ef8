"""Train TRL's real ``GRPOTrainer`` for a few steps on CPU and write what it logged as JSON.

Run by ``test_compat_trl_install.py`` in a fresh process per run, stock or
patched by ``rlmath.compat.trl.install()`` (so a patch cannot leak into the
other run). Everything is built here, nothing is downloaded: a word-level
tokenizer, a two-layer Qwen2 model from a config, eight prompts and a reward
that counts one word.

    python -m tests.peers.trl_trainer_run [--patched] OUT.json grpo dapo grpo:beta=0.04 ...

Each run is ``loss_type[:option=value,...]`` (``GRPOConfig`` options), trained
from the same initial model; the JSON holds, per run, TRL's ``log_history``
(every value with its Python type) and which code computed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from typing import Any

WORDS = [f"w{i}" for i in range(40)]
PROMPTS = [" ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(4)) for i in range(8)]
NUM_GENERATIONS = 4
BATCH = 8  # completions per step: two prompts, four completions each
MAX_COMPLETION = 8


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_model(vocab_size: int, pad_id: int, eos_id: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def reward_w0(completions: list[str], **kwargs: Any) -> list[float]:
    """Fraction of the completion's words that are ``w0``..``w9``: differs within a group."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w in WORDS[:10] for w in words) / max(len(words), 1))
    return out


def _train(spec: str, tokenizer: Any, tmp: str) -> list[dict[str, Any]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    loss_type, _, rest = spec.partition(":")
    options: dict[str, Any] = {"epsilon": 0.2, "epsilon_high": 0.28}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if value in ("true", "false"):
            options[key] = value == "true"
        else:
            options[key] = value if key == "importance_sampling_level" else float(value)
    # From a local directory: with beta > 0 TRL loads the reference model from the
    # policy's `name_or_path`.
    path = os.path.join(tmp, "model")
    if not os.path.isdir(path):
        build_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).save_pretrained(
            path
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    if not hasattr(model, "warnings_issued"):
        model.warnings_issued = {}  # TRL 0.24 writes it; transformers 5 models lack it
    config = GRPOConfig(
        output_dir=tmp, loss_type=loss_type, max_steps=4, per_device_train_batch_size=BATCH,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION,
        num_iterations=2, learning_rate=3e-2, logging_steps=1, report_to="none", use_cpu=True,
        seed=0, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, bf16=False,
        fp16=False, gradient_checkpointing=False, **options,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_w0, args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    return [
        {key: {"type": type(value).__name__, "value": value} for key, value in entry.items()}
        for entry in trainer.state.log_history
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--patched", action="store_true")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    torch.set_num_threads(1)
    installed: dict[str, Any] = {}
    if opts.patched:
        import rlmath.compat.trl

        installed = rlmath.compat.trl.install()

    import trl
    import trl.import_utils as flags

    # TRL 0.24 reads transformers' `_is_package_available` as a bool; transformers 5
    # returns `(available, version)`, a truthy tuple, so TRL would import every optional
    # package (mergekit, vllm, ...). Keep the flag the tuple holds.
    for key, value in vars(flags).items():
        if key.startswith("_") and key.endswith("_available") and isinstance(value, tuple):
            setattr(flags, key, value[0])
    from trl import GRPOTrainer

    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {spec: _train(spec, tokenizer, tmp) for spec in opts.runs}
    grpo_module = sys.modules["trl.trainer.grpo_trainer"]
    used = {
        # Which code TRL's trainer called: the module of each function or method.
        name: getattr(getattr(grpo_module, name, None), "__module__", None)
        for name in ("selective_log_softmax", "entropy_from_logits", "add_fused_lm_head")
    }
    used["_compute_loss"] = GRPOTrainer._compute_loss.__module__
    result = {"trl": trl.__version__, "installed": sorted(installed), "used": used, "runs": runs}
    with open(opts.out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    sys.exit(main())
