"""One process of a multi-process TRL GRPO run with Steptally reporting, for
``torchrun`` (gloo on CPU):

    torchrun --nproc_per_node 2 tests/support/trl_launch.py MODEL_DIR OUTPUT_DIR [STEPS]

with ``STEPTALLY_URL`` and ``STEPTALLY_RUN`` set. Each rank writes what TRL computed
(:class:`support.trl_recording.Recording`) to ``OUTPUT_DIR/rank{N}.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

from tiny_lm import grpo_config, toy_dataset, toy_reward  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from support.trl_recording import Recording  # noqa: E402


def main(model_dir: str, output_dir: str, steps: int = 3) -> None:
    trainer = Recording(
        model=model_dir,
        reward_funcs=toy_reward,
        args=grpo_config(output_dir, max_steps=steps),
        train_dataset=toy_dataset(16),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
    )
    trainer.train()
    assert trainer.steptally is not None and trainer.steptally.flush(30)
    rank = trainer.accelerator.process_index
    record = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "stats": dataclasses.asdict(trainer.steptally.stats()),
        "steps": trainer.steps,
    }
    (Path(output_dir) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
