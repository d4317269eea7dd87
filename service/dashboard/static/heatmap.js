// The rank × step completeness map, drawn on a canvas: for every finalised step,
// which ranks committed in time, which were late (committed after a partial
// finalisation) and which are still missing. Wide ranges are bucketed by pixel column,
// each cell showing the worst state of its steps.

import { getSeries, getStep, listSteps } from "./api.js";

const COLOURS = { committed: "#b9dfc6", late: "#f59e0b", missing: "#dc2626", none: "#eef0f3" };
const RANK = { committed: 0, late: 1, missing: 2 };
const DETAIL_LIMIT = 300; // flagged steps whose ranks are fetched one by one
const PAGE = 1000; // a range this short comes in one page of /steps instead
const GUTTER = 34; // px left of the cells, for the rank labels

export class Heatmap {
  // page: {run, worldSize, firstMetric, view(), select(step)}
  constructor(page, canvas, readout) {
    this.page = page;
    this.canvas = canvas;
    this.readout = readout;
    this.steps = new Map(); // step -> {status, revision, missing: Set, late: Set}
    this.downsampled = false;
    canvas.addEventListener("click", (e) => this.click(e));
    canvas.addEventListener("mousemove", (e) => this.hover(e));
    canvas.addEventListener("mouseleave", () => (this.readout.textContent = ""));
  }

  // Status of every step in view from one series (it keeps every partial and revised
  // step when downsampled), then the ranks of the flagged steps.
  async load() {
    const token = (this.loads = (this.loads ?? 0) + 1); // a newer load wins
    const view = this.page.view();
    this.canvas.dataset.state = "loading";
    if (!this.page.firstMetric) {
      this.canvas.dataset.state = "ready";
      return this.draw();
    }
    const points = Math.max(2, Math.min(10000, 2 * this.cssWidth()));
    const series = await getSeries(this.page.run, this.page.firstMetric, {
      start: view.start,
      end: view.end,
      points,
    });
    if (token !== this.loads) return;
    this.steps.clear();
    this.downsampled = series.downsampled;
    series.steps.forEach((step, i) => {
      this.steps.set(step, {
        status: series.status[i],
        revision: series.revision[i],
        missing: new Set(),
        late: new Set(),
        known: false,
      });
    });
    this.draw();
    const flagged = series.steps.filter(
      (s, i) => series.status[i] === "partial" || series.revision[i] > 1,
    );
    if (flagged.length > 6 && series.total <= PAGE) await this.fetchPage(view);
    else await this.fetchRanks(flagged.slice(-DETAIL_LIMIT));
    if (token === this.loads) this.canvas.dataset.state = "ready";
  }

  async fetchPage(view) {
    const params = { start: view.start, end: view.end, metric: this.page.firstMetric, limit: PAGE };
    try {
      const page = await listSteps(this.page.run, params);
      for (const step of page.steps) if (step.status !== "open") this.apply(step, false);
    } catch {
      /* the cells keep their status colours */
    }
    this.draw();
  }

  async fetchRanks(steps) {
    const queue = steps.slice();
    const worker = async () => {
      while (queue.length) {
        const step = queue.pop();
        try {
          this.apply(await getStep(this.page.run, step), false);
        } catch {
          /* the cell keeps its status colour */
        }
      }
    };
    await Promise.all(Array.from({ length: 6 }, worker));
    this.draw();
  }

  // A step object (from GET /steps/{step} or the event stream).
  apply(step, redraw = true) {
    const view = this.page.view();
    if (
      (view.start !== null && step.step < view.start) ||
      (view.end !== null && step.step > view.end)
    )
      return;
    const old = this.steps.get(step.step);
    if (old && old.revision > step.revision) return;
    this.steps.set(step.step, {
      status: step.status,
      revision: step.revision,
      missing: new Set(step.ranks_missing ?? []),
      late: new Set(step.ranks_late ?? []),
      known: true,
    });
    if (redraw) this.scheduleDraw();
  }

  // "committed" | "late" | "missing" | null (the step is not finalised or not in view).
  cellState(step, rank) {
    const s = this.steps.get(step);
    if (!s) return null;
    if (s.missing.has(rank)) return "missing";
    if (s.late.has(rank)) return "late";
    return "committed";
  }

  cssWidth() {
    return Math.max(100, Math.floor(this.canvas.clientWidth || 800));
  }

  layout() {
    const ranks = Math.max(1, this.page.worldSize);
    const rowHeight = Math.max(2, Math.min(14, Math.floor(160 / ranks)));
    let [first, last] = [Infinity, -Infinity];
    for (const step of this.steps.keys()) {
      if (step < first) first = step;
      if (step > last) last = step;
    }
    const view = this.page.view();
    const lo = view.start ?? (this.steps.size ? first : 0);
    const hi = view.end ?? (this.steps.size ? last : 0);
    const width = this.cssWidth() - GUTTER;
    const span = hi - lo + 1;
    return { ranks, rowHeight, lo, hi, width, stepsPerPx: span / width, colWidth: width / span };
  }

  scheduleDraw() {
    if (this.drawing) return;
    this.drawing = requestAnimationFrame(() => {
      this.drawing = null;
      this.draw();
    });
  }

  draw() {
    const g = this.layout();
    const dpr = window.devicePixelRatio || 1;
    const height = g.ranks * g.rowHeight;
    this.canvas.style.height = `${height}px`;
    this.canvas.width = Math.round(g.width * dpr);
    this.canvas.height = Math.round(height * dpr);
    const ctx = this.canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    this.labelRanks(ctx, g);
    ctx.translate(GUTTER, 0);
    ctx.fillStyle = COLOURS.none;
    ctx.fillRect(0, 0, g.width, height);
    this.layoutNow = g;
    const gap = g.colWidth >= 4 ? 1 : 0;
    const rowGap = g.rowHeight >= 6 ? 1 : 0;
    for (const [x0, x1, states] of this.columns(g)) {
      for (let r = 0; r < g.ranks; r++) {
        ctx.fillStyle = COLOURS[states[r]];
        ctx.fillRect(x0, r * g.rowHeight, Math.max(1, x1 - x0 - gap), g.rowHeight - rowGap);
      }
    }
    this.canvas.dataset.steps = String(this.steps.size);
    const label = (id, step) =>
      (document.getElementById(id).textContent = this.steps.size
        ? `step ${step.toLocaleString("en-US")}`
        : "");
    label("heat-first", g.lo);
    label("heat-last", g.hi);
  }

  // "r0", "r1", … beside the rows (every row when they are tall enough, else a few).
  labelRanks(ctx, g) {
    ctx.fillStyle = "#656d76";
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    const every = Math.ceil(11 / g.rowHeight);
    for (let r = 0; r < g.ranks; r += every)
      ctx.fillText(`r${r}`, 2, r * g.rowHeight + g.rowHeight / 2);
  }

  // [x0, x1, state per rank] for each drawn column (a step, or a bucket of steps).
  *columns(g) {
    const buckets = new Map();
    for (const [step, s] of this.steps) {
      if (step < g.lo || step > g.hi) continue;
      const col = g.colWidth >= 1 ? step - g.lo : Math.floor((step - g.lo) / g.stepsPerPx);
      let states = buckets.get(col);
      if (!states) buckets.set(col, (states = new Array(g.ranks).fill("committed")));
      for (let r = 0; r < g.ranks; r++) {
        const state = s.missing.has(r) ? "missing" : s.late.has(r) ? "late" : "committed";
        if (RANK[state] > RANK[states[r]]) states[r] = state;
      }
    }
    for (const [col, states] of buckets) {
      const x0 = g.colWidth >= 1 ? col * g.colWidth : col;
      const x1 = g.colWidth >= 1 ? x0 + g.colWidth : col + 1;
      yield [x0, x1, states];
    }
  }

  // The step and rank under a mouse event; among a bucket's steps, a flagged one first.
  locate(e) {
    const g = this.layoutNow;
    if (!g) return null;
    const box = this.canvas.getBoundingClientRect();
    const x = e.clientX - box.left - GUTTER;
    if (x < 0) return null;
    const rank = Math.min(g.ranks - 1, Math.floor((e.clientY - box.top) / g.rowHeight));
    const first = g.lo + Math.floor(x * g.stepsPerPx);
    const last = Math.max(first, g.lo + Math.floor((x + 1) * g.stepsPerPx) - 1);
    let found = null;
    for (let s = first; s <= last; s++) {
      const st = this.steps.get(s);
      if (!st) continue;
      if (found === null || st.status === "partial" || st.revision > 1) found = s;
      if (st.status === "partial") break;
    }
    return found === null ? null : { step: found, rank };
  }

  hover(e) {
    const at = this.locate(e);
    if (!at) return (this.readout.textContent = "");
    const s = this.steps.get(at.step);
    const rev = s.revision > 1 ? ` rev ${s.revision}` : "";
    this.readout.textContent = `step ${at.step} · ${s.status}${rev} · rank ${at.rank}: ${this.cellState(at.step, at.rank)}`;
  }

  click(e) {
    const at = this.locate(e);
    if (at) this.page.select(at.step);
  }
}
