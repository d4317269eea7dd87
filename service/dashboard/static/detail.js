// The step detail panel: status, revision, ranks and every metric's exact value.

import { getStep } from "./api.js";
import { el, exact, instant, integer } from "./format.js";

export class StepDetail {
  // page: {run, worldSize, metricOrder, close()}
  constructor(page, panel) {
    this.page = page;
    this.panel = panel;
    this.step = null;
  }

  async show(step) {
    this.step = step;
    this.panel.hidden = false;
    this.panel.dataset.state = "loading";
    this.panel.dataset.step = String(step);
    try {
      const body = await getStep(this.page.run, step);
      if (this.step === step) this.render(body);
    } catch (error) {
      if (this.step !== step) return;
      this.panel.replaceChildren(
        this.head(`Step ${step}`),
        el("p", { class: "empty" }, error.message),
      );
      this.panel.dataset.state = "error";
    }
  }

  hide() {
    this.step = null;
    this.panel.hidden = true;
    this.panel.replaceChildren();
  }

  // A live step object: redraw when it is the one shown.
  refresh(step) {
    if (this.step === step.step) this.render(step);
  }

  head(title, status) {
    return el(
      "div",
      { class: "panel-head" },
      el("h2", {}, title),
      status ? el("span", { class: `badge ${status}`, id: "detail-status" }, status) : null,
      el("button", { type: "button", title: "close", onclick: () => this.page.close() }, "×"),
    );
  }

  render(s) {
    const late = s.ranks_late ?? [];
    const facts = el(
      "dl",
      { class: "facts" },
      el("dt", {}, "revision"),
      el("dd", { id: "detail-revision" }, String(s.revision)),
      el("dt", {}, "ranks committed"),
      el("dd", {}, `${s.ranks_committed.length} of ${s.world_size}`),
      el("dt", {}, "ranks missing"),
      el(
        "dd",
        { id: "detail-missing", class: s.ranks_missing.length ? "rank-missing" : "" },
        s.ranks_missing.join(", ") || "none",
      ),
      el("dt", {}, "ranks late"),
      el(
        "dd",
        { id: "detail-late", class: late.length ? "rank-late" : "" },
        late.join(", ") || "none",
      ),
      el("dt", {}, "fragments"),
      el(
        "dd",
        {},
        `${integer(s.fragments.received)} received${s.fragments.expected === null ? "" : ` of ${integer(s.fragments.expected)}`}`,
      ),
      el("dt", {}, "first seen"),
      el("dd", { title: s.first_seen_at ?? "" }, instant(s.first_seen_at) ?? "–"),
      el("dt", {}, "finalised"),
      el("dd", { title: s.finalised_at ?? "" }, instant(s.finalised_at) ?? "not yet"),
    );
    this.panel.replaceChildren(
      this.head(`Step ${s.step}`, s.status),
      facts,
      ...this.breaches(s),
      el("h4", {}, "Values"),
      this.values(s),
      el("h4", {}, "Ranks"),
      this.ranks(s),
    );
    this.panel.dataset.state = "ready";
    this.panel.dataset.revision = String(s.revision);
  }

  // The alert rules this revision broke, each with what it checked.
  breaches(s) {
    const found = s.breaches ?? [];
    if (!found.length) return [];
    const rows = found.map((b) => {
      const against = {
        change_above: () => `|value − mean ${exact(b.mean)}| > ${exact(b.threshold)}`,
        non_finite: () => "not finite",
        above: () => `> ${exact(b.threshold)}`,
        below: () => `< ${exact(b.threshold)}`,
        missing_ranks_above: () => `missing ranks > ${exact(b.threshold)}`,
      }[b.condition]();
      const on = b.metric ?? "missing ranks";
      return el(
        "tr",
        { dataset: { rule: b.rule } },
        el(
          "td",
          { class: "mono", title: `${b.rule} checks ${on}` },
          b.rule,
          on === b.rule ? null : el("span", { class: "kind" }, on),
        ),
        el("td", { class: "value" }, exact(b.value)),
        el("td", { class: "num muted" }, against),
      );
    });
    return [
      el("h4", { class: "breach" }, `Alerts broken (${found.length})`),
      el(
        "table",
        { class: "grid breaches", id: "detail-breaches" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            el("th", {}, "rule"),
            el("th", { class: "num" }, "value"),
            el("th", { class: "num" }, "broke"),
          ),
        ),
        el("tbody", {}, ...rows),
      ),
    ];
  }

  values(s) {
    const known = this.page.metricOrder.filter((m) => m in s.metrics);
    const others = Object.keys(s.metrics).filter((m) => !known.includes(m));
    const rows = [...known, ...others].map((name) => {
      const m = s.metrics[name];
      return el(
        "tr",
        { dataset: { metric: name } },
        el(
          "td",
          { class: "mono", title: `${name} (${m.kind ?? "no value"})` },
          name,
          el("span", { class: "kind" }, m.kind ?? ""),
        ),
        el("td", { class: "value", title: m.reason ?? "" }, exact(m.value)),
        el(
          "td",
          { class: "num muted", title: "fragments with a value · non-finite" },
          m.kind === "derived" ? "" : `${m.values}${m.non_finite ? ` · ${m.non_finite} nf` : ""}`,
        ),
      );
    });
    return el(
      "table",
      { class: "grid", id: "detail-values" },
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          el("th", {}, "metric"),
          el("th", { class: "num" }, "value"),
          el("th", { class: "num" }, "n"),
        ),
      ),
      el("tbody", {}, rows),
    );
  }

  ranks(s) {
    const missing = new Set(s.ranks_missing);
    const late = new Set(s.ranks_late ?? []);
    const rows = Array.from({ length: s.world_size }, (_, r) => {
      const state = missing.has(r) ? "missing" : late.has(r) ? "late" : "committed";
      const owed = s.missing_fragments?.[String(r)];
      return el(
        "tr",
        { dataset: { rank: String(r), state } },
        el("td", { class: "num" }, String(r)),
        el("td", { class: state === "committed" ? "" : `rank-${state}` }, state),
        el("td", { class: "num muted" }, owed ? `${owed} fragments missing` : ""),
      );
    });
    return el(
      "table",
      { class: "grid", id: "detail-ranks" },
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          el("th", { class: "num" }, "rank"),
          el("th", {}, "state"),
          el("th", { class: "num" }, "fragments"),
        ),
      ),
      el("tbody", {}, rows),
    );
  }
}
