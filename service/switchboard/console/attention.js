// The attention queue: sessions that need an operator now (GET /v1/sessions?attention=true), each with its reasons
// and how long ago each began. It refreshes every POLL_MS over REST (with or without auth) and clears an entry when
// the service no longer reports it. In cluster mode a node that did not answer in time is named in the response's
// Switchboard-Missing-Nodes header: the queue says so, since that node's sessions are missing from it.
// A reason that was alerted (GET /v1/alerts: delivered to the server's webhook sinks) is marked with the sinks it went
// to and how each delivery went.

import { formatAge, h } from "./dom.js";

const POLL_MS = 2000;
const MISSING_NODES_HEADER = "Switchboard-Missing-Nodes";

export const REASON_LABELS = {
  generation_failed: "Model failed",
  tool_failed: "Tool failed",
  tool_long_running: "Long-running tool",
  store_failing: "Store failing",
  speech_stalled: "Speech stalled",
  silence_after_input: "Caller hears silence",
  session_failed: "Session failed",
  operator_quiet: "Operator quiet",
};

export const DELIVERY_LABELS = {
  pending: "sending",
  delivered: "delivered",
  failed: "failed",
  dropped: "dropped",
};

/** "pager (delivered), chat (sending)": the sinks an alert was opened to, and how each delivery went. */
export function alertSummary(alert) {
  return alert.deliveries
    .filter((d) => d.transition === "opened")
    .map((d) => `${d.sink} (${DELIVERY_LABELS[d.state] || d.state})`)
    .join(", ");
}

export class AttentionQueue {
  constructor({ api, list, empty, missing, count, onError }) {
    this.api = api;
    this.list = list;
    this.empty = empty;
    this.missing = missing;
    this.count = count;
    this.onError = onError;
    this.items = [];
    this.alerts = new Map(); // "<session id> <reason>" -> its open alert
    this._timer = null;
    this._tick = null;
  }

  start() {
    this.refresh();
    this._timer = setInterval(() => this.refresh(), POLL_MS);
    this._tick = setInterval(() => this._ages(), 1000);
    return this;
  }

  stop() {
    clearInterval(this._timer);
    clearInterval(this._tick);
  }

  /** The session ids in the queue, in order (for the keyboard shortcut that jumps to the next one). */
  ids() {
    return this.items.map((s) => s.id);
  }

  async refresh() {
    let answer;
    try {
      answer = await this.api.request("GET", "/v1/sessions?attention=true&limit=200", { withHeaders: true });
    } catch (err) {
      if (err.status !== 401) this.onError(err, "Loading the attention queue failed");
      return;
    }
    this.items = answer.body.items;
    this.alerts = await this._alerts();
    this._render();
    this._missing(answer.headers.get(MISSING_NODES_HEADER));
  }

  /** The open alerts by session and reason; none when they cannot be read (the queue shows without them). */
  async _alerts() {
    const found = new Map();
    try {
      const answer = await this.api.request("GET", "/v1/alerts?limit=500");
      for (const alert of answer.items) found.set(`${alert.session_id} ${alert.reason}`, alert);
    } catch (err) {
      if (err.status !== 401 && err.status !== 403) this.onError(err, "Loading the alerts failed");
    }
    return found;
  }

  /** Name the nodes that did not answer (a comma-separated header value), or hide the note when none is missing. */
  _missing(header) {
    const nodes = (header || "")
      .split(",")
      .map((id) => id.trim())
      .filter(Boolean);
    this.missing.hidden = nodes.length === 0;
    this.missing.dataset.nodes = nodes.join(",");
    const names = nodes.join(", ");
    this.missing.textContent = nodes.length ? `Not answering: ${names} — their sessions are not listed.` : "";
  }

  _render() {
    const rows = this.items.map((s) => {
      const reasons = h("ul", { class: "reasons" });
      for (const r of s.attention) {
        const item = h(
          "li",
          { dataset: { code: r.code, since: r.since } },
          h("strong", { text: REASON_LABELS[r.code] || r.code }),
          " ",
          h("span", { class: "reason-message", text: r.message }),
          " ",
          h("span", { class: "muted since", text: `${formatAge(Date.now() - Date.parse(r.since))} ago` }),
        );
        const alert = this.alerts.get(`${s.id} ${r.code}`);
        if (alert) {
          const sinks = alertSummary(alert);
          item.append(
            " ",
            h("span", {
              class: "alerted",
              dataset: { alertId: alert.id, sinks: alert.deliveries.map((d) => `${d.sink}:${d.state}`).join(",") },
              title: `Alert ${alert.id}`,
              text: sinks ? `Alerted: ${sinks}` : "Alerted (no sink subscribes)",
            }),
          );
        }
        reasons.append(item);
      }
      return h(
        "li",
        { dataset: { sessionId: s.id, state: s.state } },
        h(
          "div",
          { class: "attention-head" },
          h("a", { href: `#session=${encodeURIComponent(s.id)}`, text: s.id }),
          h("span", { class: "muted", text: ` ${s.agent} · ${s.state}` }),
        ),
        reasons,
      );
    });
    this.list.replaceChildren(...rows);
    this.empty.hidden = rows.length > 0;
    this.count.textContent = rows.length ? String(rows.length) : "";
  }

  _ages() {
    for (const el of this.list.querySelectorAll(".since")) {
      const since = el.parentElement.dataset.since;
      el.textContent = `${formatAge(Date.now() - Date.parse(since))} ago`;
    }
  }
}
