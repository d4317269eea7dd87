"""Loss benchmark: CUDA parity with CPU, zero host syncs, and the cost of the fragments.

    python bench/loss_cuda.py                 # on a machine with CUDA
    python bench/loss_cuda.py --device cpu    # the timing part on the CPU

On CUDA it (1) runs the same synthetic cases on CUDA and CPU and checks the fragments
agree (counts exactly, the rest within float64-summed float32 tolerance); (2) counts the
host syncs of loss + fragments + backward + ``reporter.log`` (the training thread's whole
share) under ``torch.cuda.set_sync_debug_mode("warn")``, once more with
``torch.use_deterministic_algorithms(True)``; (3) times loss+backward with fragments
against the loss alone on 8 sequences x 4096 tokens and prints the overhead ratio, and
what the reporter's thread spends turning one microbatch's exact parts into expansions.
It exits 1 on a parity failure or a host sync. Without CUDA it says so and exits 0.

The timing has two anchors, measured in the same run: the loss alone (its numerators are
exact sums too), and "conventional diagnostics": the same loss and fragments with every
fragment and numerator sum a plain ``tensor.sum()`` per row instead of the stacked
reproducible sum — what a framework that does not promise bit-identical fragments pays.
So the table separates the cost of the diagnostics from the cost of exactness. It also
prints how many aten kernels one forward+backward runs on the CPU in each mode (view and
allocation ops left out): on a GPU, for tensors this small, each is a kernel launch, and
the launches, not the arithmetic, set the time.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import steptally.client.loss.fragments as fragments_module
import steptally.client.loss.reduction as reduction_module
from steptally.client.loss import ClippedPGConfig, ClippedPGLoss, LossInputs, fragments_to_host
from steptally.client.loss.spec import fragment_kinds
from steptally.client.loss.synthetic import synthetic_microbatch
from steptally.client.reporter import Reporter
from steptally.client.reporter.fake import FakeService

CONFIGS = {
    "default": ClippedPGConfig(positive_example_nll_weight=0.1),
    "gspo+tis": ClippedPGConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
    ),
    "seq-mask-tis": ClippedPGConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.02,
        truncated_importance_sampling_ratio_min=0.98,
    ),
    "force+cispo": ClippedPGConfig(force_on_policy_ratio=True, ratio_clip_c=3.0),
}


def to_device(batch: LossInputs, device: str) -> LossInputs:
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.detach().to(device).requires_grad_(value.requires_grad)
    return replace(batch, **moved)


def check_parity(device: str) -> int:
    failures = 0
    for name, config in CONFIGS.items():
        kinds = fragment_kinds(config)
        for seed in range(3):
            cpu = synthetic_microbatch(seed, sequences=8, max_len=256)
            a = fragments_to_host(ClippedPGLoss(config)(cpu)[1], rounded=True)
            b = fragments_to_host(ClippedPGLoss(config)(to_device(cpu, device))[1], rounded=True)
            for key, value in a.items():
                other = b[key]
                ok = (
                    value == other
                    if kinds[key] == "count"
                    else math.isclose(value, other, rel_tol=1e-5, abs_tol=1e-9)
                )
                if not ok:
                    failures += 1
                    print(f"  parity {name} seed={seed} {key}: cpu={value!r} {device}={other!r}")
    print(f"parity cpu vs {device}: {'ok' if not failures else f'{failures} mismatches'}")
    return failures


def _logged_syncs(device: str, deterministic: bool) -> int:
    """Host syncs (``set_sync_debug_mode`` warnings) of the training thread's share."""
    batch = to_device(synthetic_microbatch(1, sequences=8, max_len=512), device)
    service = FakeService()
    syncs = 0
    torch.use_deterministic_algorithms(deterministic)
    with tempfile.TemporaryDirectory() as spool:
        for name, config in CONFIGS.items():
            loss_fn = ClippedPGLoss(config)
            run = f"bench-{name.replace('+', '-')}-{int(deterministic)}"
            with Reporter(
                "http://steptally", run=run, spec=loss_fn.metric_spec(), rank=0,
                world_size=1, transport=service.transport(), spool_dir=Path(spool),
            ) as reporter:  # fmt: skip
                for step in range(2):  # the first call warms up what is cached
                    torch.cuda.synchronize()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode("warn")
                        try:
                            loss, fragments = loss_fn(batch)
                            loss.backward()
                            reporter.log(step, fragments)
                            reporter.commit(step)
                        finally:
                            torch.cuda.set_sync_debug_mode(0)
                    if step:
                        syncs += sum("synchroniz" in str(w.message) for w in caught)
                assert reporter.flush(30) and reporter.stats().rejected == 0
    torch.use_deterministic_algorithms(False)
    return syncs


def check_no_sync(device: str) -> int:
    total = 0
    for deterministic in (False, True):
        mode = "deterministic algorithms" if deterministic else "default algorithms"
        try:
            syncs = _logged_syncs(device, deterministic)
        except RuntimeError as exc:  # an op without a deterministic implementation
            torch.use_deterministic_algorithms(False)
            torch.cuda.set_sync_debug_mode(0)
            print(f"loss+fragments+backward+reporter.log ({mode}) raised: {exc}")
            total += 1
            continue
        print(f"host syncs in loss+fragments+backward+reporter.log ({mode}): {syncs}")
        total += syncs
    return total


def _plain_sums(rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: row.to(torch.float64).sum(-1) for name, row in rows.items()}


def _plain_sums_and_values(
    summed: Mapping[str, torch.Tensor], others: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _plain_sums(summed), _plain_sums({**summed, **others})


@contextmanager
def conventional_sums() -> Iterator[None]:
    """Fragment and numerator sums as plain per-row ``sum()`` (not reproducible, and each
    fragment one rounded float64)."""
    saved = fragments_module.exact_sums_and_parts, reduction_module.exact_sums
    fragments_module.exact_sums_and_parts = _plain_sums_and_values
    reduction_module.exact_sums = _plain_sums
    try:
        yield
    finally:
        fragments_module.exact_sums_and_parts, reduction_module.exact_sums = saved


def measure_host_expansion(device: str, repeats: int) -> float:
    """Seconds the reporter's thread spends per microbatch on exact parts → expansions."""
    batch = to_device(synthetic_microbatch(3, sequences=8, max_len=4096), device)
    fragments = ClippedPGLoss(CONFIGS["default"])(batch)[1]
    parts = {n: t.detach().cpu() for n, t in fragments.items()}
    lengths = [len(v) if isinstance(v, tuple) else 1 for v in fragments_to_host(parts).values()]
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fragments_to_host(parts)
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    print(
        f"reporter thread, parts -> expansions: {seconds * 1e3:.2f} ms per microbatch "
        f"({len(lengths)} fragments, {sum(lengths)} terms on the wire, longest {max(lengths)})"
    )
    return seconds


NOT_KERNELS = frozenset(
    {
        "aten::to",
        "aten::alias",
        "aten::as_strided",
        "aten::detach",
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::expand",
        "aten::expand_as",
        "aten::lift_fresh",
        "aten::permute",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::resize_",
        "aten::scalar_tensor",
        "aten::select",
        "aten::slice",
        "aten::squeeze",
        "aten::t",
        "aten::transpose",
        "aten::unbind",
        "aten::unsqueeze",
        "aten::view",
        "aten::_unsafe_view",
    }
)


def kernel_count(fn: Callable[[], None]) -> int:
    """aten ops that do work (leaves of the op tree, views and allocations left out)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    parents = {id(e.cpu_parent) for e in events if e.cpu_parent is not None}
    return sum(1 for e in events if id(e) not in parents and e.name not in NOT_KERNELS)


def _time(fns: dict[str, Callable[[], None]], device: str, repeats: int) -> dict[str, float]:
    """Median seconds of each function, interleaved so that load drifts hit all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def measure_overhead(device: str, repeats: int) -> float:
    batch = to_device(synthetic_microbatch(3, sequences=8, max_len=4096), device)
    loss_fn = ClippedPGLoss(CONFIGS["default"])

    def alone() -> None:
        loss_fn.loss_only(batch).backward()

    def with_fragments() -> None:
        loss, _ = loss_fn(batch)
        loss.backward()

    def conventional() -> None:
        with conventional_sums():
            with_fragments()

    def conventional_alone() -> None:
        with conventional_sums():
            alone()

    fns = {
        "loss alone": alone,
        "loss alone, plain sums": conventional_alone,
        "conventional diagnostics": conventional,
        "exact fragments": with_fragments,
    }
    _time(fns, device, 3)
    times = _time(fns, device, repeats)
    kernels = {name: kernel_count(fn) for name, fn in fns.items()}
    base = times["loss alone"]
    print(f"{device}, 8 x 4096 tokens, forward+backward, median of {repeats} (interleaved):")
    for name, seconds in times.items():
        share = f"{seconds * 1e3:7.2f} ms  {seconds / base:5.2f}x"
        print(f"  {name:26s} {share}  {kernels[name]} kernels")
    ratio = times["exact fragments"] / base
    diagnostics = times["conventional diagnostics"] - times["loss alone, plain sums"]
    exactness = times["exact fragments"] - times["conventional diagnostics"]
    print(
        f"overhead ratio {ratio:.2f}: diagnostics {diagnostics * 1e3:.2f} ms, "
        f"exactness {exactness * 1e3:.2f} ms over the conventional ones"
    )
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device here: nothing to check (use --device cpu for the CPU timing)")
            return 0
        failures = check_parity("cuda")
        failures += check_no_sync("cuda")
    else:
        failures = 0
        print("cpu mode: parity and sync checks need CUDA; timing only")
    measure_overhead(args.device, args.repeats)
    measure_host_expansion(args.device, args.repeats)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
