// The read token of a service that runs with auth on (docs/security.md).
//
// Given once, as /#token=<secret> (a fragment never reaches the server, so it lands in
// no access log) or through the form shown when the API answers 401 or 403; kept in
// this tab's sessionStorage and sent as `Authorization: Bearer` by every fetch.
// EventSource cannot send headers, so the token also goes into the cookie
// `steptally_token` (path /v1/runs/, SameSite=Strict), which the service reads on the
// event stream and nowhere else.

const KEY = "steptally.token";
const COOKIE = "steptally_token";

function remember(token) {
  sessionStorage.setItem(KEY, token);
  const secure = location.protocol === "https:" ? "; Secure" : "";
  document.cookie = `${COOKIE}=${encodeURIComponent(token)}; Path=/v1/runs/; SameSite=Strict${secure}`;
}

function fromFragment() {
  const fragment = new URLSearchParams(location.hash.slice(1));
  const token = fragment.get("token");
  if (!token) return;
  remember(token.trim());
  fragment.delete("token");
  const rest = fragment.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
}

fromFragment();

export function token() {
  return sessionStorage.getItem(KEY);
}

// Headers for a fetch: the bearer token when there is one.
export function authHeaders() {
  const t = token();
  return t ? { authorization: `Bearer ${t}` } : {};
}

// Before an EventSource opens: the cookie carries the token.
export function prepareStream() {
  const t = token();
  if (t) remember(t);
}

// The API refused the page's token (401: none or not valid; 403: not a read token for
// this run): ask for one, once per page.
export function askForToken(status, message) {
  if (document.getElementById("signin")) return;
  const form = document.createElement("form");
  form.id = "signin";
  form.className = "panel signin";
  const title = document.createElement("strong");
  title.textContent =
    status === 401 ? "This service needs a read token." : "This token may not read this.";
  const why = document.createElement("span");
  why.className = "muted";
  why.textContent = message ?? "";
  const input = document.createElement("input");
  input.type = "password";
  input.name = "token";
  input.placeholder = "stt_… (steptally token create --scope read)";
  input.autocomplete = "off";
  const button = document.createElement("button");
  button.type = "submit";
  button.textContent = "Use this token";
  form.append(title, why, input, button);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    if (!input.value.trim()) return;
    remember(input.value.trim());
    location.reload();
  });
  const header = document.querySelector("header.top");
  if (header) header.after(form);
  else document.body.prepend(form);
  document.body.dataset.auth = "needed";
}
