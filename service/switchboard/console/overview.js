// The overview: sessions (state, agent state, running tools, last activity, metadata), searchable and sortable, and
// running tool calls across sessions.
//
// With auth off it follows the multi-session stream (/v1/events from the live tail, after a snapshot); a browser
// cannot send an API key on a WebSocket without putting it in the URL, so with auth on it refreshes over REST.

import { Intent } from "./api.js";
import { formatAge, formatArgs, h } from "./dom.js";
import { MultiStream } from "./stream.js";

const TYPES = "session.*,agent.state,agent.handoff,tool.started,tool.progress,tool.cancelling,tool.ended";
const POLL_MS = 2000;
const ARRANGE_MS = 200;
const RUNNING_PAGE = 1000; // the largest page of GET /v1/tool-calls

function lastActivity(data) {
  return Date.parse(data.last_activity_at || data.created_at);
}

function metadataText(metadata) {
  if (!metadata) return "";
  return Object.entries(metadata)
    .map(([k, v]) => `${k}: ${typeof v === "string" ? v : JSON.stringify(v)}`)
    .join(" · ");
}

function searchText(data) {
  return [data.id, data.agent, data.state, data.agent_state, data.owner_node, metadataText(data.metadata)]
    .join(" ")
    .toLowerCase();
}

const SORT_KEYS = {
  id: (s) => s.data.id,
  agent: (s) => s.data.agent || "",
  state: (s) => s.data.state || "",
  agent_state: (s) => s.data.agent_state || "",
  tools: (s) => Number(s.cells.tools.textContent || 0),
  owner_node: (s) => s.data.owner_node || "",
  activity: (s) => lastActivity(s.data),
};

export class Overview {
  constructor({ api, sessionsBody, sessionsEmpty, toolsList, toolsEmpty, status, onError, filter, sortHeads }) {
    this.api = api;
    this.filter = filter;
    this.sortHeads = sortHeads || [];
    this.sortKey = "activity";
    this.sortDir = -1;
    if (filter) filter.addEventListener("input", () => this._arrange());
    for (const th of this.sortHeads) {
      th.querySelector("button").addEventListener("click", () => this.sortBy(th.dataset.sort));
    }
    this.sessionsBody = sessionsBody;
    this.sessionsEmpty = sessionsEmpty;
    this.toolsList = toolsList;
    this.toolsEmpty = toolsEmpty;
    this.status = status;
    this.onError = onError;
    this.sessions = new Map(); // id -> {data, row, cells}
    this.tools = new Map(); // call_id -> {data, row, bar, msg}
    this.intents = new Map();
    this.selected = null;
    this.stream = null;
    this._poll = null;
    this._tick = setInterval(() => this._ages(), 1000);
  }

  start() {
    // if the stream cannot even connect (a proxy without WebSockets), still show a snapshot
    this._fallback = setTimeout(() => this._loaded || this.refresh(), 3000);
    this.stream = new MultiStream({
      wsUrl: (path) => this.api.wsUrl(path),
      types: TYPES,
      onReady: () => this.refresh(),
      onEvent: (ev) => this._apply(ev),
      onState: (state) => this._streamState(state),
    }).start();
    return this;
  }

  stop() {
    if (this.stream) this.stream.stop();
    clearInterval(this._poll);
    clearInterval(this._tick);
    clearTimeout(this._fallback);
    clearTimeout(this._arrangeTimer);
  }

  select(sid) {
    this.selected = sid;
    for (const [id, s] of this.sessions) s.row.setAttribute("aria-current", id === sid ? "true" : "false");
  }

  _streamState(state) {
    if (state === "unauthorized") {
      // auth is on: no key in a URL, so poll the REST API with the key in the header instead
      this.status.textContent = `Refreshing every ${POLL_MS / 1000} s`;
      this.refresh();
      clearInterval(this._poll);
      this._poll = setInterval(() => this.refresh(), POLL_MS);
      return;
    }
    this.status.textContent = state === "live" ? "Live" : "Reconnecting…";
    this.status.dataset.state = state;
  }

  /** Every running tool call, page after page (a page holds at most RUNNING_PAGE calls). */
  async runningCalls() {
    const items = [];
    let cursor = null;
    do {
      const query = cursor ? `&cursor=${encodeURIComponent(cursor)}` : "";
      const page = await this.api.get(`/v1/tool-calls?status=running&limit=${RUNNING_PAGE}${query}`);
      items.push(...page.items);
      cursor = page.next_cursor;
    } while (cursor);
    return { items };
  }

  async refresh() {
    let sessions;
    let running;
    try {
      [sessions, running] = await Promise.all([
        this.api.get("/v1/sessions?state=active&limit=200"),
        this.runningCalls(),
      ]);
    } catch (err) {
      this.onError(err);
      return;
    }
    this._loaded = true;
    const seen = new Set();
    for (const s of sessions.items) {
      seen.add(s.id);
      this._upsertSession(s);
    }
    for (const [id, s] of this.sessions) {
      // gone from the live list: ended (a failed session keeps its state; it stays listed, marked failed)
      if (!seen.has(id) && s.data.state === "active") this._upsertSession({ ...s.data, state: "closed" });
    }
    const live = new Set();
    for (const c of running.items) {
      live.add(c.call_id);
      const last = c.progress.at(-1);
      this._upsertTool({ ...c, message: last?.message ?? "", value: last?.progress ?? null });
    }
    for (const id of [...this.tools.keys()]) if (!live.has(id)) this._removeTool(id);
    this._counts();
    this._arrange();
  }

  // -- live events -----------------------------------------------------------------------------------------------

  _apply(ev) {
    const d = ev.data || {};
    const sid = ev.session_id;
    const known = this.sessions.get(sid);
    if (known && ev.at) known.data.last_activity_at = ev.at;
    switch (ev.type) {
      case "session.recovered": // recovered where it now runs (another node, after a failover): re-read its owner
        this._fetchSession(sid);
        break;
      case "session.started":
        if (!known) this._fetchSession(sid);
        else this._upsertSession({ ...known.data, state: "active", agent: d.agent || known.data.agent });
        break;
      case "session.closed":
      case "session.failed":
        if (known) this._upsertSession({ ...known.data, state: ev.type === "session.closed" ? "closed" : "failed" });
        for (const [id, t] of this.tools) if (t.data.session_id === sid) this._removeTool(id);
        break;
      case "agent.state":
        if (known) this._upsertSession({ ...known.data, agent_state: d.state });
        else this._fetchSession(sid);
        break;
      case "agent.handoff":
        if (known) this._upsertSession({ ...known.data, agent: d.to_agent });
        break;
      case "tool.started":
        this._upsertTool({
          session_id: sid,
          call_id: d.call_id,
          name: d.name,
          arguments: d.arguments,
          cancellable: d.cancellable,
          started_at: ev.at,
          message: "",
          value: null,
        });
        break;
      case "tool.progress": {
        const t = this.tools.get(d.call_id);
        if (t) this._upsertTool({ ...t.data, message: d.message, value: d.progress });
        break;
      }
      case "tool.cancelling": {
        // still running (its tool ignores the cancellation): listed until its tool.ended
        const t = this.tools.get(d.call_id);
        if (t) this._upsertTool({ ...t.data, status: "cancelling" });
        break;
      }
      case "tool.ended":
        this._removeTool(d.call_id);
        break;
      default:
        break;
    }
    this._counts();
    this._arrangeSoon();
  }

  /** Re-order and filter at most every ARRANGE_MS while events stream in (a busy service sends many). */
  _arrangeSoon() {
    if (this._arrangeTimer) return;
    this._arrangeTimer = setTimeout(() => {
      this._arrangeTimer = null;
      this._arrange();
    }, ARRANGE_MS);
  }

  async _fetchSession(sid) {
    try {
      this._upsertSession(await this.api.get(`/v1/sessions/${encodeURIComponent(sid)}`));
      this._counts();
    } catch {
      // it may be gone already; the next event or refresh tells
    }
  }

  // -- rows ------------------------------------------------------------------------------------------------------

  _upsertSession(data) {
    let s = this.sessions.get(data.id);
    if (!s) {
      const link = h("a", { href: `#session=${encodeURIComponent(data.id)}`, text: data.id });
      const cells = {
        agent: h("td"),
        state: h("td"),
        agentState: h("td"),
        tools: h("td", { class: "num" }),
        node: h("td", { class: "cluster-only node" }),
        age: h("td", { class: "num activity" }),
        metadata: h("div", { class: "metadata muted small" }),
      };
      const row = h(
        "tr",
        { dataset: { sessionId: data.id } },
        h("th", { scope: "row" }, link, cells.metadata),
        cells.agent,
        cells.state,
        cells.agentState,
        cells.tools,
        cells.node,
        cells.age,
      );
      row.setAttribute("aria-current", data.id === this.selected ? "true" : "false");
      s = { data, row, cells };
      this.sessions.set(data.id, s);
      this.sessionsBody.prepend(row); // newest first
    }
    s.data = { ...s.data, ...data };
    s.cells.agent.textContent = s.data.agent ?? "";
    s.cells.state.textContent = s.data.state ?? "";
    s.row.dataset.state = s.data.state ?? "";
    s.cells.agentState.textContent = s.data.state === "active" ? (s.data.agent_state ?? "") : "—";
    s.cells.agentState.dataset.state = s.data.agent_state ?? "";
    s.cells.metadata.textContent = metadataText(s.data.metadata);
    s.cells.node.textContent = s.data.owner_node ?? "";
    s.cells.age.textContent = formatAge(Date.now() - lastActivity(s.data));
  }

  sortBy(key) {
    this.sortDir = this.sortKey === key ? -this.sortDir : key === "activity" ? -1 : 1;
    this.sortKey = key;
    for (const th of this.sortHeads) {
      if (th.dataset.sort === key) th.setAttribute("aria-sort", this.sortDir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    }
    this._arrange();
  }

  /** Show the sessions that match the search, in the chosen order. */
  _arrange() {
    const words = (this.filter?.value || "").toLowerCase().split(/\s+/).filter(Boolean);
    const rows = [...this.sessions.values()];
    const key = SORT_KEYS[this.sortKey] || SORT_KEYS.activity;
    rows.sort((a, b) => {
      const x = key(a);
      const y = key(b);
      return (x < y ? -1 : x > y ? 1 : 0) * this.sortDir;
    });
    for (const s of rows) {
      const text = searchText(s.data);
      s.row.hidden = !words.every((w) => text.includes(w));
      this.sessionsBody.append(s.row);
    }
  }

  /** The visible session rows' ids, in order. */
  visibleIds() {
    return [...this.sessionsBody.querySelectorAll("tr")].filter((r) => !r.hidden).map((r) => r.dataset.sessionId);
  }

  _upsertTool(data) {
    let t = this.tools.get(data.call_id);
    if (!t) {
      const bar = h("progress", { max: "1", "aria-label": `Progress of ${data.name}` });
      const msg = h("span", { class: "progress-msg" });
      const head = h(
        "div",
        { class: "tool-head" },
        h("code", { class: "tool-name", text: data.name }),
        h("a", { href: `#session=${encodeURIComponent(data.session_id)}`, class: "muted", text: data.session_id }),
      );
      const row = h(
        "li",
        { dataset: { callId: data.call_id, sessionId: data.session_id } },
        head,
        h("div", { class: "args small", text: formatArgs(data.arguments) }),
        h("div", { class: "progress-line" }, bar, msg),
      );
      if (data.cancellable && !this.api.readOnly) {
        const button = h("button", {
          type: "button",
          class: "secondary small cancel",
          text: "Cancel",
          "aria-label": `Cancel ${data.name} in session ${data.session_id}`,
        });
        button.addEventListener("click", () => this.cancel(data, button));
        head.append(button);
      }
      t = { data, row, bar, msg, head };
      this.tools.set(data.call_id, t);
      this.toolsList.append(row);
    }
    t.data = { ...t.data, ...data };
    if (t.data.status === "cancelling" && !t.badge) {
      t.badge = h("span", { class: "badge status status-cancelling", text: "cancelling" });
      t.head.querySelector("button.cancel")?.remove();
      t.head.append(t.badge);
    }
    if (typeof t.data.value === "number") t.bar.value = t.data.value;
    else t.bar.removeAttribute("value");
    t.msg.textContent = t.data.message || "";
  }

  _removeTool(callId) {
    const t = this.tools.get(callId);
    if (!t) return;
    t.row.remove();
    this.tools.delete(callId);
  }

  _counts() {
    const perSession = new Map();
    for (const t of this.tools.values())
      perSession.set(t.data.session_id, (perSession.get(t.data.session_id) || 0) + 1);
    for (const [id, s] of this.sessions) s.cells.tools.textContent = String(perSession.get(id) || 0);
    this.sessionsEmpty.hidden = this.sessions.size > 0;
    this.toolsEmpty.hidden = this.tools.size > 0;
  }

  _ages() {
    const now = Date.now();
    for (const s of this.sessions.values()) s.cells.age.textContent = formatAge(now - lastActivity(s.data));
  }

  async cancel(data, button) {
    let intent = this.intents.get(data.call_id);
    if (!intent) this.intents.set(data.call_id, (intent = new Intent()));
    const path = `/v1/sessions/${encodeURIComponent(data.session_id)}/tool-calls/${encodeURIComponent(data.call_id)}/cancel`;
    const key = intent.key(path);
    button.disabled = true;
    try {
      const call = await this.api.post(path, {}, key);
      // cancelling: its tool ignored the cancellation and still runs; its tool.ended removes it
      if (call?.status === "cancelling") this._upsertTool({ ...data, status: "cancelling" });
      else this._removeTool(data.call_id);
      this._counts();
    } catch (err) {
      this.onError(err, `Cancelling ${data.name} failed`);
      button.disabled = false;
    }
  }
}
