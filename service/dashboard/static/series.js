// One run's series of one metric, kept sorted by step and updated in place by live
// steps; and the aligned columns uPlot draws from several of them.

import { plottable } from "./format.js";

export class RunSeries {
  constructor(run, body) {
    this.run = run;
    this.steps = body.steps.slice();
    this.values = body.values.slice();
    this.status = body.status.slice();
    this.revision = body.revision.slice();
    this.total = body.total;
    this.downsampled = body.downsampled;
    // step -> the alert rules on this metric that the step broke
    this.breaches = new Map();
    for (const b of body.breaches ?? []) this.breach(b.step, b.rule);
  }

  breach(step, rule) {
    const rules = this.breaches.get(step) ?? [];
    if (!rules.includes(rule)) rules.push(rule);
    this.breaches.set(step, rules);
  }

  // The index of `step`, or -(insertion point) - 1 when absent.
  find(step) {
    let lo = 0;
    let hi = this.steps.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      const s = this.steps[mid];
      if (s === step) return mid;
      if (s < step) lo = mid + 1;
      else hi = mid - 1;
    }
    return -lo - 1;
  }

  at(step) {
    const i = this.find(step);
    if (i < 0) return null;
    return {
      step,
      value: this.values[i],
      status: this.status[i],
      revision: this.revision[i],
      breaches: this.breaches.get(step) ?? [],
    };
  }

  // A finalised step from the event stream: replace it (a newer revision) or insert it.
  // A rule broken once stays marked (as GET …/breaches keeps it), whatever later revisions say.
  upsert(step, value, status, revision, rules = []) {
    for (const rule of rules) this.breach(step, rule);
    const i = this.find(step);
    if (i >= 0) {
      if (revision < this.revision[i]) return false;
      this.values[i] = value;
      this.status[i] = status;
      this.revision[i] = revision;
      return true;
    }
    const at = -i - 1;
    this.steps.splice(at, 0, step);
    this.values.splice(at, 0, value);
    this.status.splice(at, 0, status);
    this.revision.splice(at, 0, revision);
    this.total += 1;
    return true;
  }
}

// uPlot columns: x, the primary line, its partial, revised, non-finite and breach markers,
// then one line per overlay. A NaN, infinite or undefined value is a gap in the line and a
// marker along the top of the run's finite range, so it is seen, never silently dropped; a
// step that broke an alert rule on the metric is ringed where its value is drawn.
export function alignedColumns(primary, overlays) {
  const runs = [primary, ...overlays];
  const xs = overlays.length ? union(runs.map((r) => r.steps)) : primary.steps.slice();
  const position = overlays.length ? new Map(xs.map((x, i) => [x, i])) : null;
  const column = (series, pick) => {
    const out = new Array(xs.length).fill(undefined);
    series.steps.forEach((step, i) => {
      out[position ? position.get(step) : i] = pick(series, i);
    });
    return out;
  };
  const line = (s, i) => plottable(s.values[i]);
  const partial = (s, i) => (s.status[i] === "partial" ? plottable(s.values[i]) : undefined);
  const revised = (s, i) => (s.revision[i] > 1 ? plottable(s.values[i]) : undefined);
  const top = ceiling(primary.values);
  const nonFinite = (s, i) => (plottable(s.values[i]) === null ? top : undefined);
  const breach = (s, i) =>
    s.breaches.has(s.steps[i]) ? (plottable(s.values[i]) ?? top) : undefined;
  return [
    xs,
    column(primary, line),
    column(primary, partial),
    column(primary, revised),
    column(primary, nonFinite),
    column(primary, breach),
    ...overlays.map((o) => column(o, line)),
  ];
}

function ceiling(values) {
  let top = null;
  for (const v of values) {
    const y = plottable(v);
    if (y !== null && (top === null || y > top)) top = y;
  }
  return top ?? 0;
}

function union(lists) {
  const all = new Set();
  for (const list of lists) for (const x of list) all.add(x);
  return Array.from(all).sort((a, b) => a - b);
}
