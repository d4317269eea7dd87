// One metric's card: fetched when it scrolls into view, drawn with uPlot (x = step),
// partial and revised steps marked, several runs overlaid, exact values on hover.

import { getSeries } from "./api.js";
import { el, exact, integer, tick } from "./format.js";
import { RunSeries, alignedColumns } from "./series.js";

export const PRIMARY = "#2563eb";
export const OVERLAY_COLOURS = ["#0f9d8a", "#c2378f", "#8c6d31", "#5f6b7a", "#4c9a2a", "#d9480f"];
const translucent = (hex) => `${hex}b3`; // overlays never hide the run itself
const PLOT_HEIGHT = 184;
// x ticks fall on whole steps: 1, 2, 5, 10, 20, 50, …
const STEP_INCREMENTS = Array.from(
  { length: 30 },
  (_, i) => [1, 2, 5][i % 3] * 10 ** Math.floor(i / 3),
);

export class MetricChart {
  // page: {run, view(), select(step), zoom(start, end)}
  constructor(page, metric, kind, subtitle) {
    this.page = page;
    this.metric = metric;
    this.kind = kind;
    this.primary = null;
    this.overlays = [];
    this.uplot = null;
    this.pending = null; // live steps that arrive while a fetch is in flight
    this.stale = true;
    this.readout = el("span", { class: "readout" });
    this.foot = el("div", { class: "card-foot" }, "loading…");
    this.plot = el("div", { class: "plot" });
    this.card = el(
      "section",
      { class: "card", dataset: { metric, state: "idle" } },
      el(
        "div",
        { class: "card-head" },
        el("h3", {}, metric),
        el("span", { class: "sub", title: subtitle }, subtitle),
        el("span", { style: "flex:1" }),
        this.readout,
      ),
      this.plot,
      this.foot,
    );
  }

  width() {
    return Math.max(200, Math.floor(this.plot.clientWidth || this.card.clientWidth || 400));
  }

  // Fetch the view's range at about one point per pixel, for the run and its overlays.
  async load() {
    const token = (this.loads = (this.loads ?? 0) + 1); // a newer load wins
    this.stale = false;
    this.pending = [];
    this.card.dataset.state = "loading";
    const view = this.page.view();
    const range = { start: view.start, end: view.end, points: Math.min(10000, this.width()) };
    try {
      const body = await getSeries(this.page.run, this.metric, range);
      this.primary = new RunSeries(this.page.run, body);
      this.overlays = await this.loadOverlays(view.overlay, range);
    } catch (error) {
      if (token !== this.loads) return;
      this.card.dataset.state = "error";
      this.foot.textContent = `could not load: ${error.message}`;
      return;
    }
    if (token !== this.loads) return;
    const pending = this.pending;
    this.pending = null;
    for (const step of pending) this.applyStep(step, false);
    this.uplot?.destroy();
    this.uplot = null;
    this.draw();
    this.card.dataset.state = "ready";
  }

  async loadOverlays(runs, range) {
    const loaded = await Promise.all(
      runs.map((run) =>
        getSeries(run, this.metric, range).then(
          (b) => new RunSeries(run, b),
          () => null,
        ),
      ),
    );
    return loaded.filter(Boolean);
  }

  draw() {
    const data = alignedColumns(this.primary, this.overlays);
    if (this.uplot) {
      this.uplot.setData(data);
    } else {
      this.uplot = new uPlot(this.options(), data, this.plot);
    }
    this.card.dataset.points = String(this.primary.steps.length);
    this.describe();
  }

  describe() {
    const p = this.primary;
    const partial = p.status.filter((s) => s === "partial").length;
    const revised = p.revision.filter((r) => r > 1).length;
    const parts = [
      p.downsampled
        ? `${integer(p.steps.length)} of ${integer(p.total)} steps (min/max per bucket)`
        : `${integer(p.total)} steps`,
    ];
    if (partial) parts.push(`${partial} partial`);
    if (revised) parts.push(`${revised} revised`);
    if (p.breaches.size) parts.push(`${p.breaches.size} breaching`);
    const missing = this.page.view().overlay.filter((r) => !this.overlays.some((o) => o.run === r));
    if (missing.length) parts.push(`no ${this.metric} in ${missing.join(", ")}`);
    this.foot.textContent = parts.join(" · ");
  }

  options() {
    const markers = (label, fill, stroke, size) => ({
      label,
      stroke,
      fill,
      paths: () => null,
      points: { show: true, size, width: 1.5, stroke, fill },
    });
    const overlays = this.overlays.map((o, i) => ({
      label: o.run,
      stroke: translucent(OVERLAY_COLOURS[i % OVERLAY_COLOURS.length]),
      width: 1.25,
      points: { size: 3 },
    }));
    return {
      width: this.width(),
      height: PLOT_HEIGHT,
      legend: { show: false },
      cursor: {
        sync: { key: "steps" },
        drag: { x: true, y: false, setScale: false },
        points: { size: 7 },
      },
      scales: { x: { time: false, range: (u, lo, hi) => this.xRange(this.page.view(), lo, hi) } },
      axes: [
        {
          stroke: "#656d76",
          grid: { stroke: "#eef0f3" },
          ticks: { stroke: "#e1e4e8" },
          values: (u, ts) => ts.map((t) => integer(t)),
          space: 60,
          incrs: STEP_INCREMENTS,
        },
        {
          stroke: "#656d76",
          grid: { stroke: "#eef0f3" },
          ticks: { stroke: "#e1e4e8" },
          values: (u, ts) => ts.map(tick),
          size: 62,
        },
      ],
      series: [
        { label: "step" },
        { label: this.page.run, stroke: PRIMARY, width: 1.5, points: { size: 3.5, fill: PRIMARY } },
        markers("partial", "#f59e0b", "#92400e", 8),
        markers("revised", "#ffffff", "#7c3aed", 9),
        markers("non-finite", "#dc2626", "#7f1d1d", 7),
        markers("breach", "rgba(0,0,0,0)", "#dc2626", 15),
        ...overlays,
      ],
      hooks: {
        setCursor: [(u) => this.hover(u)],
        setSelect: [(u) => this.selected(u)],
        ready: [(u) => this.listen(u)],
      },
    };
  }

  xRange(view, lo, hi) {
    const start = view.start ?? lo;
    const end = view.end ?? hi;
    return start === end ? [start - 1, end + 1] : [start, end];
  }

  hover(u) {
    const i = u.cursor.idx;
    this.readout.replaceChildren();
    if (i === null || i === undefined) return;
    const step = u.data[0][i];
    const point = this.primary.at(step);
    const parts = [`step ${step}`];
    if (point) {
      parts.push(el("b", { class: "exact" }, exact(point.value)));
      if (point.status === "partial") parts.push("partial");
      if (point.revision > 1) parts.push(`rev ${point.revision}`);
      if (point.breaches.length)
        parts.push(el("span", { class: "breach" }, `⚠ ${point.breaches.join(", ")}`));
    }
    this.readout.append(...parts.flatMap((p, k) => (k ? [" ", p] : [p])));
    this.overlays.forEach((o, k) => {
      const p = o.at(step);
      const colour = OVERLAY_COLOURS[k % OVERLAY_COLOURS.length];
      this.readout.append(
        el("i", { class: "sw", style: `background:${colour}`, title: o.run }),
        p ? exact(p.value) : "–",
      );
    });
  }

  selected(u) {
    const { left, width } = u.select;
    if (width < 3) return;
    const start = Math.max(0, Math.ceil(u.posToVal(left, "x")));
    const end = Math.floor(u.posToVal(left + width, "x"));
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    if (end >= start) this.page.zoom(start, end);
  }

  listen(u) {
    let down = null;
    u.over.addEventListener("mousedown", (e) => (down = [e.clientX, e.clientY]));
    u.over.addEventListener("click", (e) => {
      const moved = down && Math.hypot(e.clientX - down[0], e.clientY - down[1]) > 3;
      const i = u.cursor.idx;
      if (!moved && i !== null && i !== undefined) this.page.select(u.data[0][i]);
    });
    u.over.addEventListener("dblclick", () => this.page.zoom(null, null));
  }

  // A step object from the event stream; `redraw` false while a batch is applied.
  applyStep(step, redraw = true) {
    if (this.pending) {
      this.pending.push(step);
      return;
    }
    if (!this.primary) return;
    const view = this.page.view();
    if (
      (view.start !== null && step.step < view.start) ||
      (view.end !== null && step.step > view.end)
    )
      return;
    const metric = step.metrics?.[this.metric];
    if (!metric) return;
    const rules = (step.breaches ?? []).filter((b) => b.metric === this.metric).map((b) => b.rule);
    const changed = this.primary.upsert(
      step.step,
      metric.value,
      step.status,
      step.revision,
      rules,
    );
    if (changed && redraw) this.scheduleDraw();
  }

  scheduleDraw() {
    if (this.drawing) return;
    this.drawing = requestAnimationFrame(() => {
      this.drawing = null;
      this.draw();
    });
  }

  resize() {
    if (this.uplot) this.uplot.setSize({ width: this.width(), height: PLOT_HEIGHT });
  }
}
