// The public REST API, as the dashboard reads it (with the read token, if one is given).

import { askForToken, authHeaders } from "./auth.js";

export class ApiError extends Error {
  constructor(status, body) {
    super(body?.error?.message ?? `HTTP ${status}`);
    this.status = status;
    this.code = body?.error?.code ?? null;
  }
}

async function get(path, params = {}) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value === null || value === undefined) continue;
    for (const v of Array.isArray(value) ? value : [value]) query.append(key, String(v));
  }
  const url = query.size ? `${path}?${query}` : path;
  const headers = { accept: "application/json", ...authHeaders() };
  const response = await fetch(url, { headers });
  const body = await response.json().catch(() => null);
  if (response.status === 401 || response.status === 403)
    askForToken(response.status, body?.error?.message);
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

const runPath = (run) => `/v1/runs/${encodeURIComponent(run)}`;

export const listRuns = (limit, cursor) => get("/v1/runs", { limit, cursor });
export const getRun = (run) => get(runPath(run));
export const getStep = (run, step) => get(`${runPath(run)}/steps/${step}`);
export const listSteps = (run, params) => get(`${runPath(run)}/steps`, params);
export const listBreaches = (run, params) => get(`${runPath(run)}/breaches`, params);
export const eventsUrl = (run) => `${runPath(run)}/events`;

// One metric of one run as a series: {steps, values, status, revision, total, downsampled}.
export async function getSeries(run, metric, { start, end, points }) {
  const path = `${runPath(run)}/series/${encodeURIComponent(metric)}`;
  const body = await get(path, { start, end, points });
  body.revision ??= body.steps.map(() => 1);
  body.total ??= body.steps.length;
  body.downsampled ??= false;
  return body;
}

// Every run name (for the overlay picker), following next_cursor.
export async function allRunNames(max = 5000) {
  const names = [];
  let cursor = null;
  do {
    const page = await listRuns(1000, cursor);
    names.push(...page.runs.map((r) => r.name));
    cursor = page.next_cursor ?? null;
  } while (cursor && names.length < max);
  return names;
}

// Metric names in display order: derived means first, then the declared metrics.
export function metricOrder(run) {
  return [...Object.keys(run.derived ?? {}), ...Object.keys(run.metrics ?? {})];
}
