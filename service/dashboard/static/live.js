// Following a run: one `step` event per finalisation from /v1/runs/{run}/events.
// EventSource reconnects by itself and sends Last-Event-ID, so the server replays
// what was missed while the connection was down.

import { eventsUrl } from "./api.js";
import { prepareStream } from "./auth.js";

// onStep(step object); onState("open" | "connecting" | "closed"). Resolves once the
// stream is open or has failed, so that fetches made after it miss no step.
export function follow(run, onStep, onState) {
  prepareStream(); // EventSource sends no headers: the token goes in a cookie
  const source = new EventSource(eventsUrl(run));
  source.addEventListener("step", (e) => onStep(JSON.parse(e.data)));
  return new Promise((resolve) => {
    source.addEventListener("open", () => {
      onState("open");
      resolve(source);
    });
    source.addEventListener("error", () => {
      onState(source.readyState === EventSource.CLOSED ? "closed" : "connecting");
      resolve(source);
    });
  });
}
