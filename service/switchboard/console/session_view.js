// One session: its header, the operator controls and the live timeline.

import { Intent } from "./api.js";
import { REASON_LABELS } from "./attention.js";
import { h } from "./dom.js";
import { CoachBox, SCHEDULED_EVENTS, WhenChoice } from "./scheduled.js";
import { SessionStream } from "./stream.js";
import { TakeoverPanel } from "./takeover.js";
import { TalkPanel } from "./talk.js";
import { Timeline } from "./timeline.js";

const STREAM_STATES = {
  connecting: "Connecting…",
  live: "Live",
  reconnecting: "Reconnecting…",
  ended: "Session closed",
  failed: "Disconnected",
};

// events after which the header re-reads the session (model latency, attention)
// (and the node that runs it, which changes when another node recovers it)
// (and who holds it, when an operator takes it over or hands it back)
const REFRESH_ON = new Set([
  "speech.done",
  "generation.failed",
  "tool.ended",
  "session.failed",
  "session.recovered",
  "session.taken_over",
  "session.handed_back",
]);

export class SessionView {
  constructor({ root, api, sid }) {
    this.root = root;
    this.api = api;
    this.sid = sid;
    this.path = `/v1/sessions/${encodeURIComponent(sid)}`;
    this.intents = new Map();
    this._token = null;
    this._render();
    this.timeline = new Timeline({
      list: this.list,
      scroller: this.scroller,
      readOnly: api.readOnly,
      fetchSpeech: (id) => this.api.get(`${this.path}/speeches/${encodeURIComponent(id)}`),
      onCancel: (callId, button) => this.cancelTool(callId, button),
      onChange: (info) => this._updateHeader(info),
    });
    this.stream = null;
  }

  async start() {
    try {
      const session = await this.api.get(this.path);
      this._updateHeader({ agent: session.agent, agentState: session.agent_state, state: session.state });
      this._showSession(session);
    } catch (err) {
      this._showError(err.message);
      if (err.status === 404 || err.status === 401 || err.status === 403) return this;
    }
    this.stream = new SessionStream({
      sid: this.sid,
      wsUrl: (path) => this.api.wsUrl(path),
      token: (fresh) => this._streamToken(fresh),
      onEvents: (events) => this._onEvents(events),
      onState: (state, detail) => this._streamState(state, detail),
    }).start();
    return this;
  }

  stop() {
    if (this.stream) this.stream.stop();
    if (this.talk) this.talk.stop();
    if (this.takeover) this.takeover.stop();
    this.timeline.stop();
    clearTimeout(this._busyTimer);
    clearTimeout(this._refreshTimer);
  }

  async _refreshSession() {
    try {
      this._showSession(await this.api.get(this.path));
    } catch {
      // the next event tries again
    }
  }

  /** The model, the last turn's latency and why the session needs attention, from a read of the session. */
  _showSession(session) {
    this.meta.node.textContent = session.owner_node ?? "—";
    const m = session.model;
    this.meta.model.textContent = m
      ? [m.model ? `${m.provider}/${m.model}` : m.provider, m.profile ? `(profile ${m.profile})` : ""]
          .concat(m.fallbacks?.length ? [`then ${m.fallbacks.join(", ")}`] : [])
          .filter(Boolean)
          .join(" ")
      : "—";
    const l = session.latency || {};
    const parts = [];
    if (l.time_to_first_token_ms != null) parts.push(`first token ${Math.round(l.time_to_first_token_ms)} ms`);
    if (l.time_to_first_audio_ms != null) parts.push(`first audio ${Math.round(l.time_to_first_audio_ms)} ms`);
    this.meta.latency.textContent = parts.join(" · ") || "—";
    const reasons = (session.attention || []).map((r) =>
      h("li", { dataset: { code: r.code } }, h("strong", { text: REASON_LABELS[r.code] || r.code }), ` ${r.message}`),
    );
    this.reasons.replaceChildren(...reasons);
    this.reasons.hidden = reasons.length === 0;
    if (this.takeover) this.takeover.show(session.takeover);
  }

  _onEvents(events) {
    this.timeline.ingest(events);
    if (this.coachBox && events.some((ev) => SCHEDULED_EVENTS.has(ev.type))) {
      clearTimeout(this._scheduledTimer);
      this._scheduledTimer = setTimeout(() => this.coachBox.refresh(), 150);
    }
    if (events.some((ev) => REFRESH_ON.has(ev.type))) {
      clearTimeout(this._refreshTimer);
      this._refreshTimer = setTimeout(() => this._refreshSession(), 250);
    }
    // while the history replays, tell assistive technology not to announce every row; live rows are announced
    if (this.list.getAttribute("aria-busy") !== "true" && this._settled) return;
    this.list.setAttribute("aria-busy", "true");
    clearTimeout(this._busyTimer);
    this._busyTimer = setTimeout(() => {
      this._settled = true;
      this.list.setAttribute("aria-busy", "false");
    }, 300);
  }

  async _streamToken(fresh) {
    if (this.api.readOnly || !this.api.apiKey) return this.api.credential;
    if (!this._token || fresh) this._token = await this.api.sessionToken(this.sid);
    return this._token;
  }

  // -- layout ----------------------------------------------------------------------------------------------------

  _render() {
    const ro = this.api.readOnly;
    this.title = h("h2", { id: "session-title", tabindex: "-1", text: `Session ${this.sid}` });
    this.meta = {
      agent: h("dd", { class: "agent" }),
      state: h("dd", { class: "state" }),
      agentState: h("dd", { class: "agent-state" }),
      running: h("dd", { class: "running" }),
      model: h("dd", { class: "model" }),
      latency: h("dd", { class: "latency" }),
      node: h("dd", { class: "node cluster-only" }),
    };
    this.reasons = h("ul", { class: "session-reasons", "aria-label": "Needs attention", hidden: true });
    this.streamStatus = h("span", { class: "conn", role: "status", "aria-live": "polite" });
    const header = h(
      "header",
      { class: "session-head" },
      h("div", { class: "title-line" }, this.title, this.streamStatus),
      h(
        "dl",
        { class: "facts" },
        h("dt", { text: "Agent" }),
        this.meta.agent,
        h("dt", { text: "State" }),
        this.meta.state,
        h("dt", { text: "Agent state" }),
        this.meta.agentState,
        h("dt", { text: "Running tools" }),
        this.meta.running,
        h("dt", { text: "Model" }),
        this.meta.model,
        h("dt", { text: "Last turn" }),
        this.meta.latency,
        h("dt", { class: "cluster-only", text: "Node" }),
        this.meta.node,
      ),
      this.reasons,
    );

    this.error = h("div", { class: "error-box", role: "alert", hidden: true });
    this.list = h("ol", {
      class: "timeline",
      role: "log",
      "aria-label": `Timeline of session ${this.sid}`,
      "aria-live": "polite",
      "aria-relevant": "additions",
    });
    this.scroller = h("div", { class: "timeline-scroll", tabindex: "0", "aria-label": "Timeline" }, this.list);
    const showAll = h("input", { type: "checkbox", id: "show-all" });
    showAll.addEventListener("change", () => this.list.classList.toggle("show-all", showAll.checked));
    const exportButton = h("button", {
      type: "button",
      id: "op-export",
      class: "secondary small",
      text: "Export JSON",
      title: "Download the whole session (chat, tool calls, events) as one JSON document",
    });
    exportButton.addEventListener("click", () => this.exportSession(exportButton));
    const toolbar = h(
      "div",
      { class: "timeline-tools" },
      h("label", { for: "show-all" }, showAll, " Show every event"),
      h("span", { class: "spacer" }),
      exportButton,
    );

    const parts = [header, this.error, toolbar, this.scroller];
    if (!ro) {
      this.talk = new TalkPanel({ api: this.api, sid: this.sid });
      this.takeover = new TakeoverPanel({
        path: this.path,
        api: this.api,
        command: (...args) => this._command(...args),
        showError: (message) => this._showError(message),
        lastError: () => this._lastError,
      });
      parts.push(this.takeover.element, this._controls(), this.talk.element);
    }
    this.root.replaceChildren(...parts);
  }

  _controls() {
    this.text = h("textarea", {
      id: "op-text",
      rows: "2",
      placeholder: "Type a message…",
      "aria-describedby": "op-help",
    });
    this.reply = h("input", { type: "checkbox", id: "op-reply", checked: true });
    this.interruptFirst = h("input", { type: "checkbox", id: "op-interrupt", checked: true });
    const send = h("button", { type: "submit", class: "primary", id: "op-send", text: "Send as user" });
    const say = h("button", { type: "button", id: "op-say", text: "Agent says it" });
    say.addEventListener("click", () => this.say(say));
    this.when = new WhenChoice();
    const form = h(
      "form",
      { class: "composer", "aria-label": "Operator input" },
      h("label", { for: "op-text", class: "sr-only", text: "Message" }),
      this.text,
      h(
        "div",
        { class: "composer-row" },
        h("label", { for: "op-reply" }, this.reply, " Agent replies"),
        h("label", { for: "op-interrupt" }, this.interruptFirst, " Interrupt current speech"),
        this.when.element,
        h("span", { class: "spacer" }),
        send,
        say,
      ),
      h("p", { id: "op-help", class: "muted small", text: "Ctrl+Enter sends as user input." }),
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.sendInput(send);
    });
    this.text.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        this.sendInput(send);
      }
    });

    const interrupt = h("button", { type: "button", id: "op-interrupt-now", text: "Interrupt" });
    interrupt.addEventListener("click", () => this.interrupt(interrupt, false));
    const force = h("button", {
      type: "button",
      id: "op-force",
      class: "warn",
      text: "Force interrupt",
      title: "Interrupt even a speech that does not allow interruptions",
    });
    force.addEventListener("click", () => this.interrupt(force, true));
    const close = h("button", { type: "button", id: "op-close", class: "danger", text: "Close session…" });
    const confirm = h("button", {
      type: "button",
      id: "op-close-confirm",
      class: "danger",
      hidden: true,
      text: "Yes, close it",
    });
    const keep = h("button", { type: "button", id: "op-close-keep", hidden: true, text: "Keep it open" });
    close.addEventListener("click", () => {
      close.hidden = true;
      confirm.hidden = keep.hidden = false;
      confirm.focus();
    });
    keep.addEventListener("click", () => {
      confirm.hidden = keep.hidden = true;
      close.hidden = false;
      close.focus();
    });
    confirm.addEventListener("click", async () => {
      await this.closeSession(confirm);
      confirm.hidden = keep.hidden = true;
      close.hidden = false;
    });
    const actions = h(
      "div",
      { class: "session-actions", role: "group", "aria-label": "Session controls" },
      interrupt,
      force,
      h("span", { class: "spacer" }),
      close,
      confirm,
      keep,
    );
    this.closedNote = h("p", {
      class: "muted",
      hidden: true,
      text: "This session has ended; it takes no more commands.",
    });
    this.coachBox = new CoachBox({
      api: this.api,
      path: this.path,
      command: (...args) => this._command(...args),
    });
    this.coachBox.refresh();
    this.controls = h(
      "section",
      { class: "controls", "aria-label": "Controls" },
      this.closedNote,
      actions,
      form,
      this.coachBox.element,
    );
    return this.controls;
  }

  _setEnded(ended) {
    if (!this.controls || this._ended === ended) return;
    this._ended = ended;
    this.closedNote.hidden = !ended;
    for (const el of this.controls.querySelectorAll("button, textarea, input")) el.disabled = ended;
    for (const el of this.takeover.element.querySelectorAll("button, textarea")) el.disabled = ended;
  }

  _updateHeader(info) {
    if (info.agent) this.meta.agent.textContent = info.agent;
    if (info.state) {
      this.meta.state.textContent = info.state;
      this.root.dataset.sessionState = info.state;
      this._setEnded(info.state !== "active");
      if (this.streamStatus.dataset.state === "ended") this._streamState("ended"); // closed or failed
    }
    if (info.agentState) {
      this.meta.agentState.textContent = info.agentState;
      this.meta.agentState.dataset.state = info.agentState;
    }
    if (typeof info.running === "number") this.meta.running.textContent = String(info.running);
    if (typeof info.lastSeq === "number") this.root.dataset.lastSeq = String(info.lastSeq);
  }

  _streamState(state, detail) {
    const failed = state === "ended" && this.root.dataset.sessionState === "failed";
    this.streamStatus.textContent = failed ? "Session failed" : STREAM_STATES[state] || state;
    this.streamStatus.dataset.state = state;
    if (state === "failed" && detail) this._showError(detail);
  }

  _showError(message) {
    this.error.textContent = message;
    this.error.hidden = false;
  }

  _clearError() {
    this.error.hidden = true;
    this.error.textContent = "";
  }

  // -- commands --------------------------------------------------------------------------------------------------

  /** Run one operator command: one Idempotency-Key per intention, button busy meanwhile, errors in plain words. */
  async _command(name, button, method, path, body, describe) {
    let intent = this.intents.get(name);
    if (!intent) this.intents.set(name, (intent = new Intent()));
    const key = intent.key(`${method} ${path} ${JSON.stringify(body ?? null)}`);
    if (button.getAttribute("aria-busy") === "true") return null; // the same intention is already on its way
    button.setAttribute("aria-busy", "true");
    button.disabled = true;
    try {
      const result = method === "DELETE" ? await this.api.delete(path, key) : await this.api.post(path, body, key);
      this._lastError = null;
      this._clearError();
      return result ?? {};
    } catch (err) {
      this._lastError = err;
      this._showError(`${describe} failed: ${err.message}`);
      return null;
    } finally {
      button.removeAttribute("aria-busy");
      button.disabled = Boolean(this._ended);
    }
  }

  /** The composer's text; empty right after a send is the second click of a double click, not a mistake. */
  _composed(hint) {
    const text = this.text.value.trim();
    if (!text && performance.now() - (this._sentAt || 0) > 1500) this._showError(hint);
    return text;
  }

  _sent(text) {
    this._sentAt = performance.now();
    if (this.text.value.trim() === text) this.text.value = "";
  }

  async sendInput(button) {
    const text = this._composed("Type a message first.");
    if (!text) return;
    const body = { text, reply: this.reply.checked, interrupt: this.interruptFirst.checked };
    if (!this._withWhen(body)) return;
    const res = await this._command("input", button, "POST", `${this.path}/input`, body, "Sending the input");
    if (res) this._accepted(text, res);
  }

  async say(button) {
    const text = this._composed("Type what the agent should say first.");
    if (!text) return;
    const body = { text };
    if (!this._withWhen(body)) return;
    const res = await this._command("say", button, "POST", `${this.path}/say`, body, "Saying it");
    if (res) this._accepted(text, res);
  }

  /** Add the "when" choice to a command's body; false (and why, shown) when it is incomplete. */
  _withWhen(body) {
    try {
      const when = this.when.value();
      if (when) body.when = when;
      return true;
    } catch (err) {
      this._showError(err.message);
      return false;
    }
  }

  _accepted(text, res) {
    this._sent(text);
    if (res.scheduled) {
      this.when.reset();
      this.coachBox.refresh();
    }
  }

  async interrupt(button, force) {
    const res = await this._command(
      force ? "force" : "interrupt",
      button,
      "POST",
      `${this.path}/interrupt`,
      { force },
      "Interrupting",
    );
    if (res && res.interrupted === false) this._showError("Nothing to interrupt: the agent is not speaking.");
  }

  async cancelTool(callId, button) {
    const path = `${this.path}/tool-calls/${encodeURIComponent(callId)}/cancel`;
    await this._command(`cancel:${callId}`, button, "POST", path, {}, "Cancelling the tool call");
  }

  /** Download GET .../export as session-<id>.json (a read: live, closed and failed sessions alike). */
  async exportSession(button) {
    button.disabled = true;
    try {
      const doc = await this.api.get(`${this.path}/export`);
      const url = URL.createObjectURL(new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" }));
      const link = h("a", { href: url, download: `session-${this.sid}.json`, hidden: true });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
      this._clearError();
    } catch (err) {
      this._showError(`Exporting the session failed: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  async closeSession(button) {
    await this._command("close", button, "DELETE", this.path, null, "Closing the session");
  }
}
