// The run page: charts per metric (derived means first), the completeness heat map,
// the step detail panel, overlays, a view held in the URL, and live steps over SSE.

import { getRun, listBreaches, metricOrder } from "./api.js";
import { MetricChart } from "./chart.js";
import { StepDetail } from "./detail.js";
import { el, integer, when } from "./format.js";
import { Heatmap } from "./heatmap.js";
import { follow } from "./live.js";
import { MetricPicker, OverlayControl } from "./toolbar.js";
import { readView, writeView } from "./view.js";

const $ = (id) => document.getElementById(id);

class RunPage {
  constructor(run) {
    this.run = run;
    this.state = readView();
    this.charts = new Map();
    this.visible = new Set();
  }

  view() {
    return this.state;
  }

  async start() {
    const live = follow(
      this.run,
      (s) => this.onStep(s),
      (state) => this.onLive(state),
    );
    const info = await getRun(this.run);
    this.info = info;
    this.worldSize = info.world_size;
    this.metricOrder = metricOrder(info);
    this.firstMetric = this.metricOrder[0] ?? null;
    this.summarise(info);
    this.heatmap = new Heatmap(this, $("heatmap"), $("heat-readout"));
    this.detail = new StepDetail(this, $("detail"));
    this.picker = new MetricPicker(this);
    this.overlay = new OverlayControl(this);
    $("range-reset").addEventListener("click", () => this.zoom(null, null));
    this.buildCharts();
    this.showRange();
    await Promise.race([live, new Promise((r) => setTimeout(r, 2000))]);
    this.ready = true;
    this.observe();
    this.heatmap.load();
    if (this.state.step !== null) this.detail.show(this.state.step);
    window.addEventListener("resize", () => this.resized());
    document.addEventListener("keydown", (e) => this.key(e));
  }

  // Escape closes the step detail; ← and → step through the steps while it is open.
  key(e) {
    if (this.state.step === null || e.target.closest?.("input")) return;
    if (e.key === "Escape") this.close();
    else if (e.key === "ArrowLeft" && this.state.step > 0) this.select(this.state.step - 1);
    else if (e.key === "ArrowRight") this.select(this.state.step + 1);
  }

  // The run's alert rules and how many steps broke each (from the run's answer).
  showAlerts(info) {
    const rules = info.alerts ?? [];
    const box = $("alerts");
    box.hidden = !rules.length;
    const counts = info.breaches ?? {};
    box.replaceChildren(
      el("span", { class: "muted" }, "alerts"),
      ...rules.map((r) => {
        const n = counts[r.name] ?? 0;
        return el(
          n ? "button" : "span",
          {
            class: `alert-rule${n ? " broken" : ""}`,
            dataset: { rule: r.name, count: String(n) },
            title: `${JSON.stringify(r)}${n ? " · click: the next step that broke it" : ""}`,
            onclick: n ? () => this.nextBreach(r.name) : null,
          },
          `${r.name} ${integer(n)}`,
        );
      }),
    );
  }

  // Open the next step after the one shown that broke `rule` (from the first, and round).
  async nextBreach(rule) {
    const after = this.state.step ?? -1;
    const page = await listBreaches(this.run, { rule, start: after + 1, limit: 1 });
    const found = page.breaches[0] ?? (await listBreaches(this.run, { rule, limit: 1 })).breaches[0];
    if (found) this.select(found.step);
  }

  summarise(info) {
    this.showAlerts(info);
    const s = info.steps;
    const last = info.last_finalised_step;
    const at = info.last_finalised_at ? ` ${when(info.last_finalised_at)}` : "";
    $("run-summary").textContent =
      `${info.world_size} ${info.world_size === 1 ? "rank" : "ranks"} · ${integer(s.complete)} complete · ${integer(s.partial)} partial · ${integer(s.open)} open` +
      (last === null ? "" : ` · last step ${integer(last)}${at}`);
  }

  shownMetrics() {
    const chosen = new Set(this.state.metrics);
    return chosen.size ? this.metricOrder.filter((m) => chosen.has(m)) : this.metricOrder;
  }

  buildCharts() {
    const box = $("charts");
    box.replaceChildren();
    this.charts.clear();
    const shown = new Set(this.shownMetrics());
    const derived = Object.keys(this.info.derived ?? {}).filter((m) => shown.has(m));
    const declared = Object.keys(this.info.metrics ?? {}).filter((m) => shown.has(m));
    const group = (title, names, subtitle) => {
      if (!names.length) return;
      const grid = el("div", { class: "charts" });
      for (const name of names) {
        const chart = new MetricChart(this, name, subtitle(name), subtitle(name));
        this.charts.set(name, chart);
        grid.append(chart.card);
      }
      box.append(el("h2", { class: "section-title" }, title), grid);
    };
    group("Derived means", derived, (m) => `= ${this.info.derived[m]}`);
    group("Declared metrics", declared, (m) => this.info.metrics[m]);
    this.observe();
  }

  // Cards fetch their series when they come near the viewport.
  observe() {
    this.observer?.disconnect();
    if (!this.ready) return;
    this.observer = new IntersectionObserver(
      (entries) => {
        for (const entry of entries) {
          const chart = this.charts.get(entry.target.dataset.metric);
          if (!chart) continue;
          if (entry.isIntersecting) {
            this.visible.add(chart);
            if (chart.stale) chart.load();
          } else this.visible.delete(chart);
        }
      },
      { rootMargin: "150px 0px" },
    );
    for (const chart of this.charts.values()) this.observer.observe(chart.card);
  }

  // A new view range or overlay: visible charts refetch now, the rest when seen.
  reload() {
    writeView(this.state);
    this.showRange();
    for (const chart of this.charts.values()) {
      chart.stale = true;
      if (this.visible.has(chart)) chart.load();
    }
    this.heatmap.load();
  }

  zoom(start, end) {
    if (this.state.start === start && this.state.end === end) return;
    Object.assign(this.state, { start, end });
    this.reload();
  }

  select(step) {
    this.state.step = step;
    writeView(this.state);
    this.detail.show(step);
  }

  close() {
    this.state.step = null;
    writeView(this.state);
    this.detail.hide();
  }

  showRange() {
    const { start, end } = this.state;
    const zoomed = start !== null || end !== null;
    $("range-label").textContent = zoomed
      ? `steps ${integer(start ?? 0)} – ${end === null ? "latest" : integer(end)}`
      : "all steps";
    $("range-reset").hidden = !zoomed;
  }

  onStep(step) {
    for (const chart of this.charts.values()) chart.applyStep(step);
    this.heatmap?.apply(step);
    this.detail?.refresh(step);
    this.count(step);
  }

  onLive(state) {
    document.body.dataset.live = state;
    $("live").textContent = { open: "live", connecting: "reconnecting", closed: "not live" }[state];
  }

  // The header's counts follow the events at once; the run summary (a count over every
  // step, costly on a long run) is refetched at most every 30 s to settle them.
  count(step) {
    const info = this.info;
    const steps = info.steps;
    if (step.revision === 1) {
      steps[step.status] += 1;
      steps.open = Math.max(0, steps.open - 1);
    } else if (step.status === "complete" && steps.partial > 0) {
      steps.partial -= 1;
      steps.complete += 1;
    }
    if (info.last_finalised_step === null || step.step >= info.last_finalised_step) {
      info.last_finalised_step = step.step;
      info.last_finalised_at = step.finalised_at;
    }
    this.summarise(info);
    // a breach settles the counts within a second; otherwise every 30 s at most
    const soon = (step.breaches ?? []).length > 0;
    if (this.summaryTimer && !(soon && this.summaryDelay > 1000)) return;
    clearTimeout(this.summaryTimer);
    this.summaryDelay = soon ? 1000 : 30_000;
    this.summaryTimer = setTimeout(async () => {
      this.summaryTimer = null;
      this.info = { ...this.info, ...(await getRun(this.run)) };
      this.summarise(this.info);
    }, this.summaryDelay);
  }

  resized() {
    for (const chart of this.charts.values()) chart.resize();
    this.heatmap.draw();
  }

  // An empty choice, or every metric, is the default view: all of them.
  chooseMetrics(names) {
    this.state.metrics = names.length === this.metricOrder.length ? [] : names;
    writeView(this.state);
    this.buildCharts();
  }

  setOverlay(runs) {
    this.state.overlay = runs;
    this.reload();
  }
}

const page = new RunPage(document.body.dataset.run);
window.steptally = page; // for the browser tests: charts, heatmap, detail
page.start().catch((error) => {
  // with auth on, an unknown run or a refused token shows here (the page is served as is)
  $("run-summary").textContent = `could not load the run: ${error.message}`;
  document.body.dataset.state = "error";
});
