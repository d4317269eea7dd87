// The view a URL holds: ?metrics=a,b&start=&end=&overlay=run-b,run-c&step=
// so that a copied link reproduces what is on screen.

function names(text) {
  return text
    ? text
        .split(",")
        .map((s) => s.trim())
        .filter(Boolean)
    : [];
}

function step(text) {
  if (text === null || text === "" || !/^\d+$/.test(text)) return null;
  return Number(text);
}

export function readView(search = location.search) {
  const q = new URLSearchParams(search);
  return {
    metrics: names(q.get("metrics")),
    start: step(q.get("start")),
    end: step(q.get("end")),
    overlay: names(q.get("overlay")),
    step: step(q.get("step")),
  };
}

// The query string of a view; lists keep their commas readable.
export function viewQuery(view) {
  const parts = [];
  const list = (key, items) =>
    items.length && parts.push(`${key}=${items.map(encodeURIComponent).join(",")}`);
  const one = (key, value) => value !== null && parts.push(`${key}=${value}`);
  list("metrics", view.metrics);
  one("start", view.start);
  one("end", view.end);
  list("overlay", view.overlay);
  one("step", view.step);
  return parts.length ? `?${parts.join("&")}` : "";
}

export function writeView(view) {
  history.replaceState(null, "", `${location.pathname}${viewQuery(view)}`);
}
