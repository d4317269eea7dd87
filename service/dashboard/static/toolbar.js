// The run page's toolbar controls: which metrics are charted, and which runs are overlaid.
// Both write the page's view (and so the URL) through the page.

import { allRunNames } from "./api.js";
import { OVERLAY_COLOURS, PRIMARY } from "./chart.js";
import { el } from "./format.js";

const $ = (id) => document.getElementById(id);

// A dropdown of checkboxes with a filter box; ?metrics= holds the choice.
export class MetricPicker {
  // page: {metricOrder, shownMetrics(), chooseMetrics(names)}
  constructor(page) {
    this.page = page;
    const list = $("metric-list");
    const shown = new Set(page.shownMetrics());
    this.boxes = page.metricOrder.map((name) => {
      const box = el("input", { type: "checkbox", value: name });
      box.checked = shown.has(name);
      box.addEventListener("change", () => this.choose(this.checked()));
      list.append(el("label", { dataset: { metric: name } }, box, name));
      return box;
    });
    $("metric-filter").addEventListener("input", (e) => {
      const text = e.target.value.toLowerCase();
      for (const label of list.children)
        label.hidden = !label.dataset.metric.toLowerCase().includes(text);
    });
    $("metrics-all").addEventListener("click", () => {
      for (const b of this.boxes) b.checked = true;
      this.choose([]);
    });
    this.count();
  }

  checked() {
    return this.boxes.filter((b) => b.checked).map((b) => b.value);
  }

  choose(names) {
    this.page.chooseMetrics(names);
    this.count();
  }

  count() {
    const n = this.page.shownMetrics().length;
    $("metric-count").textContent = `${n} of ${this.page.metricOrder.length}`;
  }
}

// A run-name input (with every run as a suggestion) and a chip per overlaid run.
export class OverlayControl {
  // page: {run, view(), setOverlay(runs)}
  constructor(page) {
    this.page = page;
    allRunNames().then(
      (names) => {
        const others = names.filter((n) => n !== page.run);
        $("run-names").replaceChildren(...others.map((n) => el("option", { value: n })));
      },
      () => {},
    );
    $("overlay-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const name = $("overlay-input").value.trim();
      $("overlay-input").value = "";
      const overlay = page.view().overlay;
      if (name && name !== page.run && !overlay.includes(name)) this.set([...overlay, name]);
    });
    this.show();
  }

  set(runs) {
    this.page.setOverlay(runs);
    this.show();
  }

  show() {
    const overlay = this.page.view().overlay;
    const chip = (name, i) =>
      el(
        "span",
        { class: "chip", dataset: { run: name } },
        el("i", { style: `background:${OVERLAY_COLOURS[i % OVERLAY_COLOURS.length]}` }),
        name,
        el(
          "button",
          {
            type: "button",
            title: `remove ${name}`,
            onclick: () => this.set(overlay.filter((r) => r !== name)),
          },
          "×",
        ),
      );
    const primary = el(
      "span",
      { class: "chip primary" },
      el("i", { style: `background:${PRIMARY}` }),
      this.page.run,
    );
    const chips = overlay.map(chip);
    $("overlay-chips").replaceChildren(...(chips.length ? [primary, ...chips] : []));
  }
}
