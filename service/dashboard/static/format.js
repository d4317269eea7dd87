// Values as the REST API sends them, shown exactly; and a small DOM builder.

// A value from the API: a number, "NaN" / "Infinity" / "-Infinity", or null (undefined).
// String(x) is the shortest text that reads back as the same float64.
export function exact(value) {
  if (value === null || value === undefined) return "undefined";
  return String(value);
}

// The number a chart can draw, or null (a gap) for NaN, infinities and undefined.
export function plottable(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

// Axis tick text: short, never misleading about magnitude.
export function tick(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(1);
  return String(Number(v.toPrecision(4)));
}

// An ISO time as "2026-12-02 04:40:21.899 UTC".
export function instant(iso) {
  if (!iso) return null;
  return `${new Date(iso).toISOString().replace("T", " ").replace("Z", "")} UTC`;
}

export function integer(n) {
  return n === null || n === undefined ? "–" : n.toLocaleString("en-US");
}

export function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  const secs = Math.round((Date.now() - d.getTime()) / 1000);
  if (secs < 60) return `${Math.max(secs, 0)} s ago`;
  if (secs < 3600) return `${Math.round(secs / 60)} min ago`;
  if (secs < 86400) return `${Math.round(secs / 3600)} h ago`;
  return d.toISOString().slice(0, 16).replace("T", " ");
}

// el("td", {class: "num", title: "x"}, "text", child, ...): text is never parsed as HTML.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
