"""A real ``trl.GRPOTrainer`` loop on CPU with a tiny, randomly initialised model.

Nothing comes from the Hugging Face hub: the model is built from a ``Qwen2Config``, the
tokenizer from an in-memory word-level vocabulary, the dataset from plain strings.
Importing this module sets ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` /
``HF_DATASETS_OFFLINE`` (a child process launched afterwards inherits them).
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
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "bird",
    "fish",
    "runs",
    "jumps",
    "sits",
    "sleeps",
    "eats",
    "big",
    "small",
    "fast",
    "slow",
    "and",
    "or",
    "not",
    "yes",
    "no",
    "good",
    "bad",
]
REWARD_WORD = "yes"
SEED = 1234
EOS_PROB = 0.15  # per-token chance of EOS at init: most completions end before 8 tokens

# Each entry: a `filterwarnings` spec for the warnings a tiny CPU run emits that no setting removes.
WARNING_FILTERS: list[str] = [
    # TRL 1.16 reads the deprecated alias in `unwrap_model_for_generation` on every generation
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning:transformers.modeling_utils",
]


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
        model_max_length=64,
    )


def tiny_model_dir(path: Path) -> Path:
    """Save a seeded tiny Qwen2 causal LM and its tokenizer into ``path``; return ``path``."""
    tokenizer = tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
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


def train(
    trainer_cls: type[GRPOTrainer],
    model_dir: str | Path,
    output_dir: str | Path,
    *,
    n_prompts: int = 16,
    **config_overrides: Any,
) -> GRPOTrainer:
    """Build ``trainer_cls`` on the tiny model in ``model_dir``, train it, return it."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    trainer = trainer_cls(
        model=str(model_dir),
        reward_funcs=toy_reward,
        args=grpo_config(output_dir, **config_overrides),
        train_dataset=toy_dataset(n_prompts),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer
