"""An independent float64 reference of every loss diagnostic, written from the
definitions alone (see ``tests/unit/test_loss_reference.py`` for the mask rules and the
tolerances): random batches with ``-inf`` on both sides, and the whole-batch values
Σ numerator / Σ count each diagnostic should have. Of the loss it imports only the
config and the fragment names."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from steptally.client.loss import ClippedPGConfig
from steptally.client.loss.names import Diagnostic as D
from steptally.client.loss.names import Fragment as F

REL = 1e-12
INF = float("inf")
GARBAGE = (float("nan"), -INF, INF, 1e300, -7.0)  # outside token_mask: must never count
SAMPLE_WEIGHTS = (1.0, 1.0, 1.0, 0.5, 0.25, 0.0)
Grid = list[list[float]]
Flags = list[list[bool]]


@dataclass
class Batch:
    curr: Grid
    unfiltered: Grid
    prev: Grid
    gen: Grid
    ref: Grid
    adv: Grid
    token: Flags
    sample: list[float]
    reward: list[float]
    prev_keep: Flags | None


def _row_mask(rng: random.Random, row: int, width: int) -> list[bool]:
    """Row 0 empty, row 1 one token, the others a prompt then a response of uneven length."""
    if row == 0:
        return [False] * width
    if row == 1:
        at = rng.randrange(width)
        return [t == at for t in range(width)]
    length = rng.randint(3, width)
    prompt = rng.randint(0, length // 2)
    return [prompt <= t < length for t in range(width)]


def random_batch(seed: int, rows: int = 13, width: int = 24, prev_keep: bool = True) -> Batch:
    """-inf on both sides (row 3 wholly on the previous side), garbage outside the token
    mask, a zero and fractional sample weights, mixed-sign advantages."""
    rng = random.Random(seed)
    b = Batch([], [], [], [], [], [], [], [], [], [] if prev_keep else None)
    for row in range(rows):
        mask = _row_mask(rng, row, width)
        score = rng.gauss(0.0, 1.0)
        b.token.append(mask)
        b.sample.append(0.0 if row == 2 else rng.choice(SAMPLE_WEIGHTS))
        b.reward.append(1.0 if score > 0 else 0.0)
        grids: dict[str, list[float]] = {
            n: [] for n in ("curr", "unf", "prev", "gen", "ref", "adv")
        }
        for t in range(width):
            gen = -rng.uniform(0.05, 3.0)
            prev = min(gen + rng.gauss(0.0, 0.08), -1e-3)
            curr = min(prev + rng.gauss(0.0, 0.15), -1e-3)
            values = {
                "unf": curr,
                "curr": -INF if rng.random() < 0.12 else curr,
                "prev": -INF if rng.random() < 0.12 or row == 3 else prev,
                "gen": gen,
                "ref": curr + rng.gauss(0.0, 0.2),
                "adv": score + rng.gauss(0.0, 0.3),
            }
            for name, value in values.items():
                grids[name].append(value if mask[t] else rng.choice(GARBAGE))
        for name, grid in (
            ("curr", b.curr), ("unf", b.unfiltered), ("prev", b.prev),
            ("gen", b.gen), ("ref", b.ref), ("adv", b.adv),
        ):  # fmt: skip
            grid.append(grids[name])
        if b.prev_keep is not None:
            b.prev_keep.append([rng.random() > 0.06 for _ in range(width)])
    return b


# --- the reference -----------------------------------------------------------------------


@dataclass
class Tally:
    """Σ weight·value exactly, with the float64 scale of its terms (0 while all exact)."""

    total: Fraction = Fraction(0)
    scale: float = 0.0
    exact: bool = True

    def add(self, weight: float, value: float, size: float | None = None) -> None:
        """``size`` None: the value is exact; else its largest intermediate's magnitude."""
        self.total += Fraction(weight) * Fraction(value)
        if size is not None:
            self.exact = False
            self.scale += abs(weight) * size


@dataclass(frozen=True)
class Expected:
    value: float | None
    tol: float


@dataclass
class Extreme:
    values: list[tuple[float, bool]] = field(default_factory=list)  # (value, exact)

    def expected(self, pick: Callable[..., tuple[float, bool]]) -> Expected:
        if not self.values:
            return Expected(None, 0.0)
        value, exact = pick(self.values, key=lambda v: v[0])
        return Expected(value, 0.0 if exact else REL * abs(value))


@dataclass
class Masks:
    full: Flags
    keep_curr: Flags
    keep_prev: Flags
    actor: Flags
    mismatch: Flags
    prev: Grid  # the previous side's values (the current ones under force_on_policy_ratio)


def reference_masks(config: ClippedPGConfig, b: Batch) -> Masks:
    rows = range(len(b.token))
    cols = range(len(b.token[0]))
    full = [[b.token[i][t] and b.sample[i] > 0 for t in cols] for i in rows]
    keep_curr = [[b.token[i][t] and b.curr[i][t] != -INF for t in cols] for i in rows]
    prev = b.curr if config.force_on_policy_ratio else b.prev
    if config.force_on_policy_ratio:
        keep_prev = keep_curr
    else:
        keep_prev = [
            [
                b.token[i][t]
                and b.prev[i][t] != -INF
                and (b.prev_keep is None or b.prev_keep[i][t])
                for t in cols
            ]
            for i in rows
        ]
    actor = [[full[i][t] and keep_curr[i][t] and keep_prev[i][t] for t in cols] for i in rows]
    mismatch = [[full[i][t] and keep_prev[i][t] for t in cols] for i in rows]
    return Masks(full, keep_curr, keep_prev, actor, mismatch, prev)


def k_estimate(x: float, kind: str) -> tuple[float, float]:
    """The KL estimator and the magnitude of its largest intermediate."""
    if kind == "k1":
        return -x, abs(x)
    if kind == "k2":
        return x * x / 2, x * x
    e = math.exp(x)
    return e - 1 - x, max(e, 1.0, abs(x))


def clamp(x: float, low: float, high: float) -> tuple[float, bool]:
    """(clamped, whether the result is a bound: then it is exact)."""
    if x < low:
        return low, True
    if x > high:
        return high, True
    return x, False


def positions(mask: Flags, i: int) -> list[int]:
    return [t for t, on in enumerate(mask[i]) if on]


def mean_over(values: list[float], at: list[int]) -> float:
    """The mean over ``at`` of ``values`` (an empty set's mean is 0, so exp of it is 1)."""
    return float(sum((Fraction(values[t]) for t in at), Fraction(0)) / len(at)) if at else 0.0


def ratios(config: ClippedPGConfig, b: Batch, m: Masks, i: int, t: int) -> tuple:
    """((r, r exact), (r_c, r_c exact)) at an actor position."""
    c, p = b.curr[i][t], m.prev[i][t]
    if config.disable_ppo_ratio:
        return (c, True), (c, True)
    if config.gspo:
        at = positions(m.actor, i)
        log_r = mean_over([b.curr[i][s] - m.prev[i][s] for s in range(len(b.curr[i]))], at)
    else:
        log_r = c - p
    r = math.exp(log_r)
    exact = log_r == 0.0  # exp(0) = 1 in any libm (force_on_policy_ratio)
    rc, at_bound = clamp(r, 1.0 - config.ratio_clip_min, 1.0 + config.ratio_clip_max)
    return (r, exact), (rc, exact or at_bound)


@dataclass
class Importance:
    """Per-token weights for the loss, and the diagnostics' tallies."""

    weight: Grid
    ratio: Tally
    oob: Tally


def truncate(config: ClippedPGConfig, w: float) -> tuple[float, float]:
    """(truncated weight, out-of-bounds flag) for tis/icepop; w itself otherwise."""
    kind = config.truncated_importance_sampling_type
    if kind not in ("tis", "icepop"):
        return w, 0.0
    high = config.truncated_importance_sampling_ratio
    low = config.truncated_importance_sampling_ratio_min or 0.0
    assert high is not None
    oob = 1.0 if (w < low or w > high) else 0.0
    if kind == "tis":
        return min(max(w, low), high), oob
    return (w if low <= w <= high else 0.0), oob


def finite_or_zero(w: float) -> float:
    return w if math.isfinite(w) else 0.0


def importance(config: ClippedPGConfig, b: Batch, m: Masks) -> Importance:
    rows, cols = range(len(b.token)), range(len(b.token[0]))
    weight = [[1.0 for _ in cols] for _ in rows]
    ratio, oob = Tally(), Tally()
    kind = config.truncated_importance_sampling_type
    for i in rows:
        at = positions(m.mismatch, i)
        log_w = [m.prev[i][t] - b.gen[i][t] if m.mismatch[i][t] else 0.0 for t in cols]
        if config.gspo:  # w_i = exp(Σ_t (prev - gen)·M), a per-sequence weight
            total = sum((Fraction(log_w[t]) * Fraction(b.sample[i]) for t in at), Fraction(0))
            w, flag = truncate(config, finite_or_zero(math.exp(float(total))))
            weight[i] = [w for _ in cols]
            ratio.add(b.sample[i], w, w)
            if kind is not None:
                oob.add(b.sample[i], flag)
            continue
        gate = 1.0
        if kind == "seq-mask-tis":
            g = math.exp(mean_over(log_w, at))
            low, high = (
                config.truncated_importance_sampling_ratio_min,
                config.truncated_importance_sampling_ratio,
            )
            assert low is not None and high is not None
            gate = 1.0 if low <= g <= high else 0.0
            oob.add(b.sample[i], 1.0 - gate)
        for t in at:
            w, flag = truncate(config, finite_or_zero(math.exp(log_w[t])))
            weight[i][t] = w * gate
            ratio.add(b.sample[i], w * gate, w)
            if kind in ("tis", "icepop"):
                oob.add(b.sample[i], flag)
    return Importance(weight, ratio, oob)


def surrogate(config: ClippedPGConfig, adv: float, c: float, r: float, rc: float) -> tuple:
    """(ℓ, size): max(-A·r, -A·r_c); CISPO -A·r_c·curr; dual clip min(ℓ, -A·c) where A < 0."""
    if config.use_cispo:
        loss, size = -adv * rc * c, abs(adv * rc * c)
    else:
        loss, size = max(-adv * r, -adv * rc), abs(adv) * max(abs(r), abs(rc))
    if config.ratio_clip_c is not None and adv < 0:
        loss = min(loss, -adv * config.ratio_clip_c)
        size = max(size, abs(adv) * config.ratio_clip_c)
    return loss, size


def kl_term(config: ClippedPGConfig, b: Batch, i: int, t: int) -> tuple[float, float]:
    """(the per-token KL without β, size) over the full mask, from the unfiltered curr."""
    cu = b.unfiltered[i][t]
    log_r = b.ref[i][t] - cu
    if config.kl_input_clamp_value is not None:
        bound = config.kl_input_clamp_value
        log_r = min(max(log_r, -bound), bound)
    est, size = k_estimate(log_r, config.reference_policy_kl_type)
    q = math.exp(cu - b.gen[i][t]) if config.use_on_policy_kl_approximation else 1.0
    kl = q * est
    if config.kl_output_clamp_value is not None:
        bound = config.kl_output_clamp_value
        kl = min(max(kl, -bound), bound)
    return kl, q * size


def mismatch_terms(p: float, g: float, kind: str) -> dict[str, tuple[float, float]]:
    """The four mismatch metrics at one token, with their sizes (straight from the table)."""
    m = math.log(0.5 * math.exp(p) + 0.5 * math.exp(g))

    def h(x: float) -> tuple[float, float]:
        e = math.exp(x - m)
        return e - (x - m) - 1, max(e, 1.0, abs(x - m)) + abs(m)

    hp, hg = h(p), h(g)
    tmpe = math.exp(abs(g - p))
    return {
        D.TOKEN_MULT_PROB_ERROR: (tmpe, tmpe),
        D.GEN_KL_ERROR: k_estimate(p - g, kind),
        D.POLICY_KL_ERROR: k_estimate(g - p, kind),
        D.JS_DIVERGENCE_ERROR: (0.5 * (hp[0] + hg[0]), hp[1] + hg[1]),
    }


@dataclass
class Reference:
    """Every tally of one batch under one config."""

    counts: dict[str, Fraction] = field(default_factory=dict)
    sums: dict[str, Tally] = field(default_factory=dict)
    extremes: dict[str, Extreme] = field(default_factory=dict)

    def tally(self, name: str) -> Tally:
        return self.sums.setdefault(name, Tally())


def count_positions(b: Batch, m: Masks, ref: Reference, nll: bool) -> None:
    counts = ref.counts
    for name in (F.VALID_TOKENS, F.ACTOR_TOKENS, F.MISMATCH_TOKENS, F.CORRECT_TOKENS):
        counts[name] = Fraction(0)
    for name in (
        F.ACTOR_POSITIONS, F.MASK_POSITIONS, F.FILTERED_CURR_TOKENS, F.FILTERED_PREV_TOKENS,
    ):  # fmt: skip
        counts[name] = Fraction(0)
    counts[F.VALID_SEQS] = sum((Fraction(s) for s in b.sample), Fraction(0))
    for i, row in enumerate(m.full):
        w = Fraction(b.sample[i])
        for t, on in enumerate(row):
            if not on:
                continue
            counts[F.VALID_TOKENS] += w
            counts[F.CORRECT_TOKENS] += w if b.reward[i] > 0 else 0
            counts[F.ACTOR_TOKENS] += w if m.actor[i][t] else 0
            counts[F.ACTOR_POSITIONS] += 1 if m.actor[i][t] else 0
            counts[F.MASK_POSITIONS] += 1
            counts[F.MISMATCH_TOKENS] += w if m.mismatch[i][t] else 0
            counts[F.FILTERED_CURR_TOKENS] += 0 if m.keep_curr[i][t] else 1
            counts[F.FILTERED_PREV_TOKENS] += 0 if m.keep_prev[i][t] else 1
    if not nll:
        del counts[F.CORRECT_TOKENS]


def actor_side(
    config: ClippedPGConfig, b: Batch, m: Masks, imp: Importance, ref: Reference
) -> None:
    """Ratios and their extrema, entropy, the actor loss and the NLL, over the actor mask."""
    for name in (F.PROBS_RATIO_MIN, F.PROBS_RATIO_MAX):
        ref.extremes[name] = Extreme()
    for name in (F.PROBS_RATIO_CLAMPED_MIN, F.PROBS_RATIO_CLAMPED_MAX):
        ref.extremes[name] = Extreme()
    loss = ref.tally(F.ACTOR_LOSS_NUM)
    for i in range(len(m.actor)):
        w_i = b.sample[i]
        row_loss, row_size = Fraction(0), 0.0
        for t in positions(m.actor, i):
            (r, r_exact), (rc, rc_exact) = ratios(config, b, m, i, t)
            c, g = b.curr[i][t], b.gen[i][t]
            ref.tally(F.PROBS_RATIO_NUM).add(w_i, r, None if r_exact else abs(r))
            ref.tally(F.PROBS_RATIO_CLAMPED_NUM).add(w_i, rc, None if rc_exact else abs(rc))
            for name in (F.PROBS_RATIO_MIN, F.PROBS_RATIO_MAX):
                ref.extremes[name].values.append((r, r_exact))
            for name in (F.PROBS_RATIO_CLAMPED_MIN, F.PROBS_RATIO_CLAMPED_MAX):
                ref.extremes[name].values.append((rc, rc_exact))
            entropy = -math.exp(c - g) * c
            ref.tally(F.APPROX_ENTROPY_NUM).add(w_i, entropy, abs(entropy))
            ell, size = surrogate(config, b.adv[i][t], c, r, rc)
            if config.use_importance_sampling_correction:
                ell, size = ell * imp.weight[i][t], size * imp.weight[i][t]
            row_loss += Fraction(ell)
            row_size += size
            if config.nll_enabled and b.reward[i] > 0:
                ref.tally(F.NLL_NUM).add(w_i, -c)
        if config.token_level_loss:
            loss.add(w_i, float(row_loss), row_size)
        elif any(b.token[i]):  # the per-sequence mean over the original token mask
            n = sum(b.token[i])
            loss.add(w_i, float(row_loss / n), row_size / n)
    if config.nll_enabled:
        ref.tally(F.NLL_NUM)  # present even when no correct token is retained


def kl_side(config: ClippedPGConfig, b: Batch, m: Masks, ref: Reference) -> None:
    """The reference KL over the full mask (never narrowed), reduced like the actor loss."""
    if not config.kl_enabled:
        return
    tally = ref.tally(F.KL_PENALTY_NUM)
    for i in range(len(b.token)):
        terms = [kl_term(config, b, i, t) for t in positions(m.full, i)]
        total = sum((Fraction(v) for v, _ in terms), Fraction(0))
        size = sum(s for _, s in terms)
        n = 1 if config.token_level_loss else sum(b.token[i])
        if terms:
            tally.add(b.sample[i], float(total / n), size / n)


def mismatch_side(config: ClippedPGConfig, b: Batch, m: Masks, ref: Reference) -> None:
    """The four mismatch metrics over full ∧ keep(prev)."""
    kind = config.reference_policy_kl_type
    for name in (D.TOKEN_MULT_PROB_ERROR, D.GEN_KL_ERROR, D.POLICY_KL_ERROR, D.JS_DIVERGENCE_ERROR):
        ref.tally(f"{name}_num")
    for i in range(len(b.token)):
        for t in positions(m.mismatch, i):
            terms = mismatch_terms(m.prev[i][t], b.gen[i][t], kind)
            for name, (value, size) in terms.items():
                # k1 of a difference is the difference itself: exact
                exact = kind == "k1" and name in (D.GEN_KL_ERROR, D.POLICY_KL_ERROR)
                ref.tally(f"{name}_num").add(b.sample[i], value, None if exact else size)


def reference(config: ClippedPGConfig, b: Batch) -> Reference:
    m = reference_masks(config, b)
    ref = Reference()
    count_positions(b, m, ref, config.nll_enabled)
    imp = importance(config, b, m)
    ref.sums[F.SAMPLING_IMPORTANCE_RATIO_NUM] = imp.ratio
    if config.truncated_importance_sampling_type is not None:
        ref.sums[F.IS_OOB_NUM] = imp.oob
    actor_side(config, b, m, imp, ref)
    kl_side(config, b, m, ref)
    mismatch_side(config, b, m, ref)
    return ref


def of_tally(t: Tally, count: Fraction = Fraction(1)) -> tuple[Fraction, float]:
    return t.total / count, (0.0 if t.exact else REL * t.scale / count)


def expected_values(config: ClippedPGConfig, ref: Reference) -> dict[str, Expected]:
    """Every fragment and every derived step value of the spec, from the reference."""
    out = {name: Expected(float(value), 0.0) for name, value in ref.counts.items()}
    out.update({name: Expected(float(t.total), of_tally(t)[1]) for name, t in ref.sums.items()})
    for name, extreme in ref.extremes.items():
        out[name] = extreme.expected(min if name.endswith("_min") else max)
    c = ref.counts
    per_seq = config.gspo
    oob_seq = per_seq or config.truncated_importance_sampling_type == "seq-mask-tis"
    denominators: dict[str, Fraction] = {
        D.PROBS_RATIO: c[F.ACTOR_TOKENS],
        D.PROBS_RATIO_CLAMPED: c[F.ACTOR_TOKENS],
        D.APPROX_ENTROPY: c[F.ACTOR_TOKENS],
        D.TOKEN_MULT_PROB_ERROR: c[F.MISMATCH_TOKENS],
        D.GEN_KL_ERROR: c[F.MISMATCH_TOKENS],
        D.POLICY_KL_ERROR: c[F.MISMATCH_TOKENS],
        D.JS_DIVERGENCE_ERROR: c[F.MISMATCH_TOKENS],
        D.SAMPLING_IMPORTANCE_RATIO: c[F.VALID_SEQS if per_seq else F.MISMATCH_TOKENS],
        D.IS_OOB_RATIO: c[F.VALID_SEQS if oob_seq else F.MISMATCH_TOKENS],
        D.ACTOR_LOSS: c[F.VALID_TOKENS if config.token_level_loss else F.VALID_SEQS],
    }
    denominators[D.KL_PENALTY] = denominators[D.ACTOR_LOSS]
    if config.nll_enabled:
        denominators[D.POSITIVE_NLL_LOSS] = c[F.CORRECT_TOKENS]
    means: dict[str, tuple[Fraction, float]] = {}
    numerators = {D.POSITIVE_NLL_LOSS: F.NLL_NUM, D.IS_OOB_RATIO: F.IS_OOB_NUM}
    for name, count in denominators.items():
        numerator = numerators.get(name, f"{name}_num")
        if numerator in ref.sums:
            means[name] = of_tally(ref.sums[numerator], count)
    total, tol = means[D.ACTOR_LOSS]
    for name, factor in (
        (D.KL_PENALTY, config.reference_policy_kl_penalty),
        (D.POSITIVE_NLL_LOSS, config.positive_example_nll_weight),
    ):
        if name in means:
            total += Fraction(factor) * means[name][0]
            tol += factor * means[name][1]
    means[D.LOSS] = (total, tol + REL * abs(float(total)))
    out.update({name: Expected(float(v), tol) for name, (v, tol) in means.items()})
    out[D.NUM_VALID_SAMPLES] = Expected(float(c[F.VALID_SEQS]), 0.0)
    if c[F.MASK_POSITIONS]:  # exact integers, divided once
        share = (c[F.MASK_POSITIONS] - c[F.ACTOR_POSITIONS]) / c[F.MASK_POSITIONS]
        out[D.FILTERED_TOKEN_SHARE] = Expected(float(share), 0.0)
    return out
