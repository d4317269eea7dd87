"""A tiny, randomly initialised causal LM for a GRPO run on CPU, with nothing downloaded.

The model is built from a ``Qwen2Config``, the tokenizer from an in-memory word-level
vocabulary, the prompts from plain strings, the reward from word counts: enough for a
real ``trl.GRPOTrainer`` loop to train in seconds (``examples/trl_grpo.py``, the tests and
``bench/trl_step.py`` use it). Importing this module sets ``HF_HUB_OFFLINE`` and its
siblings, so nothing reaches for the hub (a child process inherits them).
"""

from __future__ import annotations

import math
import os

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
VOCABULARY = (
    "the a one two three four five six seven eight nine ten red green blue cat dog bird "
    "fish runs jumps sits sleeps eats big small fast slow and or not yes no good bad"
)
WORDS = tuple(VOCABULARY.split())
REWARD_WORD = "yes"
SEED = 1234
EOS_PROB = 0.15  # per-token chance of EOS at init: most completions end before 8 tokens


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``WORDS``: ids 0..2 are pad, eos, unk."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )


def tiny_model_dir(path: Path, hidden: int = 32, layers: int = 2) -> Path:
    """Save a seeded tiny Qwen2 causal LM (``hidden`` wide, ``layers`` deep) and its
    tokenizer into ``path``; return ``path``."""
    tokenizer = tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    _make_eos_likely(model, tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _make_eos_likely(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Give every word embedding a shared direction ``c`` and the EOS row ``EOS_GAIN * c``.

    At init the residual stream is almost the input embedding, so the final hidden state is
    about ``sqrt(hidden) * c``: every word's logit rises by ``sqrt(hidden)``, EOS's by
    ``EOS_GAIN * sqrt(hidden)``. With tied embeddings this makes EOS about ``EOS_PROB`` likely
    per token and pad/unk essentially never sampled, so completions end at uneven lengths.
    """
    emb = model.get_input_embeddings().weight
    hidden = emb.shape[1]
    c = torch.randn(hidden)
    c /= c.norm()
    n_words = len(WORDS)
    gain = 1.0 + math.log(EOS_PROB / (1.0 - EOS_PROB) * n_words) / math.sqrt(hidden)
    specials = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    with torch.no_grad():
        for i in range(emb.shape[0]):
            if i not in specials:
                emb[i] += c
        emb[tokenizer.eos_token_id] = gain * c


def toy_dataset(n: int) -> Dataset:
    """``n`` plain-text prompts made of vocabulary words."""
    prompts = [
        " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 3)) for i in range(n)
    ]
    return Dataset.from_dict({"prompt": prompts})


def toy_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Deterministic: twice the count of ``REWARD_WORD`` minus a tenth of the word count."""
    return [2.0 * c.split().count(REWARD_WORD) - 0.1 * len(c.split()) for c in completions]


def grpo_config(output_dir: str | Path, **overrides: Any) -> GRPOConfig:
    """A quick, deterministic CPU ``GRPOConfig``; ``overrides`` replace any field."""
    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "activation_checkpointing": False,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "num_iterations": 2,
        "beta": 0.04,
        "gradient_accumulation_steps": 2,
        "max_completion_length": 8,
        "max_steps": 3,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "seed": SEED,
        "data_seed": SEED,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)
