"""``import steptally.client`` never imports torch; the loss package does."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_client_import_does_not_import_torch():
    code = (
        "import sys\n"
        "import steptally.client, steptally.client.algebra\n"
        "assert 'torch' not in sys.modules, 'steptally.client imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_loss_api_is_pinned():
    pytest.importorskip("torch")
    import steptally.client.loss as loss

    assert sorted(loss.__all__) == sorted(
        [
            "EXTREME_COMPANIONS",
            "ClippedPGConfig",
            "ClippedPGLoss",
            "ConfigError",
            "Diagnostic",
            "Fragment",
            "InputError",
            "LossError",
            "LossInputs",
            "Normalisers",
            "PackedLossInputs",
            "exact_sum",
            "fragments_to_host",
            "local_normalisers",
            "mask_out_neg_inf_logprobs",
            "metric_spec",
            "pack",
            "unpack",
        ]
    )
