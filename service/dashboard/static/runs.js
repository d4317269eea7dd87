// The runs list: every run, a page at a time (the API's next_cursor), newest state.

import { listRuns } from "./api.js";
import { el, integer, when } from "./format.js";

const $ = (id) => document.getElementById(id);
const PAGE_SIZE = 100;

function progress(steps) {
  const total = steps.complete + steps.partial + steps.open;
  const part = (cls, n) =>
    n ? el("span", { class: cls, style: `width:${(100 * n) / total}%` }) : null;
  return el(
    "div",
    {
      class: "bar",
      title: `${steps.complete} complete, ${steps.partial} partial, ${steps.open} open`,
    },
    part("complete", steps.complete),
    part("partial", steps.partial),
    part("open", steps.open),
  );
}

function row(run) {
  const s = run.steps;
  return el(
    "tr",
    { dataset: { run: run.name } },
    el(
      "td",
      {},
      el("a", { class: "run-link", href: `/runs/${encodeURIComponent(run.name)}` }, run.name),
    ),
    el("td", { class: "num" }, String(run.world_size)),
    el("td", {}, progress(s)),
    el("td", { class: "num" }, integer(s.complete)),
    el("td", { class: s.partial ? "num warn" : "num" }, integer(s.partial)),
    el("td", { class: "num" }, integer(s.open)),
    el("td", { class: "num" }, integer(run.last_finalised_step)),
    el("td", { title: run.last_finalised_at ?? "" }, when(run.last_finalised_at)),
    el("td", { title: run.created_at ?? "", class: "muted" }, when(run.created_at)),
  );
}

// The page a URL names: ?cursor= from the previous page's next_cursor, ?limit= rows.
function wanted() {
  const q = new URLSearchParams(location.search);
  const limit = /^\d+$/.test(q.get("limit") ?? "") ? Number(q.get("limit")) : PAGE_SIZE;
  return { cursor: q.get("cursor"), limit };
}

async function show() {
  const { cursor, limit } = wanted();
  const page = await listRuns(limit, cursor);
  $("runs").tBodies[0].replaceChildren(...page.runs.map(row));
  $("runs-empty").hidden = page.runs.length > 0 || cursor !== null;
  $("runs-count").textContent =
    `${page.runs.length} shown${page.next_cursor ? ", more on the next page" : ""}`;
  const keep = limit === PAGE_SIZE ? "" : `limit=${limit}`;
  const first = $("page-first");
  first.hidden = cursor === null;
  first.href = keep ? `/?${keep}` : "/";
  const next = $("page-next");
  next.hidden = !page.next_cursor;
  if (page.next_cursor)
    next.href = `/?${keep ? `${keep}&` : ""}cursor=${encodeURIComponent(page.next_cursor)}`;
  document.body.dataset.state = "ready";
}

show().catch((error) => {
  $("runs-count").textContent = `could not load the runs: ${error.message}`;
  document.body.dataset.state = "error";
});
