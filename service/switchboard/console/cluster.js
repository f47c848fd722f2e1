// The cluster panel: the nodes serving this database (GET /v1/cluster/nodes) with their state, the sessions each
// runs and how long ago each renewed its lease. Shown only in cluster mode; the page's body carries the `cluster`
// class then, which also shows each session's node (the sessions table's column, the session header's field).

import { formatAge, h } from "./dom.js";

const POLL_MS = 2000;
// a live node renews its lease several times per lease (2 s by default): a heartbeat older than this is overdue
const OVERDUE_MS = 3000;

export class ClusterPanel {
  constructor({ api, section, body, count }) {
    this.api = api;
    this.section = section;
    this.body = body;
    this.count = count;
    this.nodes = new Map(); // id -> {data, row, cells}
    this.clusterMode = false;
  }

  start() {
    this.refresh();
    this._poll = setInterval(() => this.refresh(), POLL_MS);
    this._tick = setInterval(() => this._ages(), 1000);
    return this;
  }

  stop() {
    clearInterval(this._poll);
    clearInterval(this._tick);
  }

  async refresh() {
    let items;
    try {
      items = (await this.api.get("/v1/cluster/nodes")).items;
    } catch {
      return; // the overview reports what is wrong with the service or the key; keep the last view
    }
    this.clusterMode = items.some((n) => n.mode === "cluster");
    document.body.classList.toggle("cluster", this.clusterMode);
    this.section.hidden = !this.clusterMode;
    const seen = new Set(items.map((n) => n.id));
    for (const [id, n] of this.nodes) {
      if (!seen.has(id)) {
        n.row.remove();
        this.nodes.delete(id);
      }
    }
    for (const data of items) this._upsert(data);
    for (const data of items) this.body.append(this.nodes.get(data.id).row); // the service's order: live first
    const live = items.filter((n) => n.state === "live").length;
    this.count.textContent = `${live} live`;
  }

  _upsert(data) {
    let n = this.nodes.get(data.id);
    if (!n) {
      const cells = {
        url: h("div", { class: "muted small node-url" }),
        state: h("td", { class: "node-state" }),
        sessions: h("td", { class: "num node-sessions" }),
        heartbeat: h("td", { class: "num node-heartbeat" }),
      };
      const row = h(
        "tr",
        { dataset: { nodeId: data.id } },
        h("th", { scope: "row" }, h("code", { text: data.id }), cells.url),
        cells.state,
        cells.sessions,
        cells.heartbeat,
      );
      n = { data, row, cells };
      this.nodes.set(data.id, n);
    }
    n.data = data;
    n.cells.url.textContent = data.url;
    n.cells.state.textContent = data.state;
    n.row.dataset.state = data.state;
    n.cells.sessions.textContent = String(data.sessions);
    this._age(n, Date.now());
  }

  _age(n, now) {
    const ms = now - Date.parse(n.data.heartbeat_at);
    n.cells.heartbeat.textContent = `${formatAge(ms)} ago`;
    n.cells.heartbeat.title = n.data.heartbeat_at;
    n.row.dataset.overdue = String(n.data.state === "live" && ms > OVERDUE_MS);
  }

  _ages() {
    const now = Date.now();
    for (const n of this.nodes.values()) this._age(n, now);
  }
}
