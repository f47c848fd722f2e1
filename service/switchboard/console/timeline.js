// The session timeline: one row per event, ordered by seq (rows carry data-seq).
//
// Events that start something visible (a user input, a speech, a tool call, a handoff, a recovery) get a full row;
// the events that update it (tool.progress, speech.interrupted, tool.ended, ...) change that row in place and add
// only a compact row that stays hidden unless "Show every event" is on. Events are queued and applied once per
// animation frame: new rows are built off-document in a DocumentFragment and appended in one go, so a long replay
// renders quickly and a live event never re-renders what is already there.

import { appendPinned, clock, formatArgs, h, nextFrame, splitHeard, truncate } from "./dom.js";

const OUTPUT_MAX = 2000;
const LIVE_POLL_MS = 400;

function summary(ev) {
  const d = ev.data || {};
  switch (ev.type) {
    case "agent.state":
      return `agent is ${d.state}`;
    case "user.input":
      return `${d.final ? "" : "interim: "}${truncate(d.text, 120)}`;
    case "speech.created":
      return `${d.speech_id} (${d.source})`;
    case "generation.started":
      return `${d.speech_id} step ${d.step}${d.preemptive ? " (preemptive)" : ""}`;
    case "generation.speculative":
      return `${d.state}: ${truncate(d.user_text || "", 80)}`;
    case "speech.started":
      return d.speech_id;
    case "speech.interrupted":
      return `${d.speech_id} after “${truncate(d.played_text || "", 80)}”`;
    case "speech.done":
      return `${d.speech_id}${d.interrupted ? " (interrupted)" : ""}`;
    case "chat.item": {
      const it = d.item || {};
      if (it.type === "message") return `${it.role}: ${truncate(it.text, 120)}`;
      if (it.type === "function_call") return `call ${it.name}(${formatArgs(it.arguments)})`;
      if (it.type === "function_call_output") return `output of ${it.name}: ${truncate(it.output, 120)}`;
      if (it.type === "agent_handoff") return `handoff ${it.from_agent} → ${it.to_agent}`;
      return it.type || "";
    }
    case "tool.progress":
      return `${d.call_id}: ${d.message || ""}${d.progress == null ? "" : ` (${Math.round(d.progress * 100)}%)`}`;
    case "tool.cancelling":
      return `${d.call_id} cancelling (${d.reason || "cancelled"}): the tool has not stopped yet`;
    case "tool.ended":
      return `${d.call_id} ${d.status}`;
    case "operator.action":
      return `${d.actor}: ${d.action}`;
    case "operator.spoke":
      return `${d.operator}: ${truncate(d.text, 120)}`;
    case "scheduled.created":
      return `${d.kind} scheduled (${d.at}${d.call_id ? ` ${d.call_id}` : ""})`;
    case "scheduled.applied":
      return `${d.kind} ${d.id} applied`;
    case "scheduled.cancelled":
      return `${d.kind} ${d.id} cancelled (${d.reason})`;
    default:
      return "";
  }
}

export class Timeline {
  /**
   * @param {object} o
   * @param {HTMLOListElement} o.list     the <ol> rows go into
   * @param {HTMLElement} o.scroller      the element that scrolls
   * @param {boolean} o.readOnly          hide controls (embedded with a read-only token)
   * @param {(speechId: string) => Promise<object>} o.fetchSpeech   GET .../speeches/{id}
   * @param {(callId: string, button: HTMLButtonElement) => void} o.onCancel
   * @param {(info: object) => void} o.onChange   after each batch: {agent, agentState, state, running, lastSeq}
   */
  constructor({ list, scroller, readOnly = false, fetchSpeech, onCancel, onChange }) {
    this.list = list;
    this.scroller = scroller;
    this.readOnly = readOnly;
    this.fetchSpeech = fetchSpeech;
    this.onCancel = onCancel;
    this.onChange = onChange;
    this.lastSeq = 0;
    this.speeches = new Map();
    this.tools = new Map();
    this.inputs = new Map(); // committed input's chat item id -> its text (for the audit trail's rows)
    this.activeSpeech = null;
    this.info = { agent: null, agentState: null, state: "active", running: 0, lastSeq: 0 };
    this._queue = [];
    this._scheduled = false;
  }

  /** Queue events (in seq order); they are applied on the next frame. */
  ingest(events) {
    for (const ev of events) this._queue.push(ev);
    if (!this._scheduled) {
      this._scheduled = true;
      nextFrame(() => this.flush());
    }
  }

  /** Apply every queued event now. */
  flush() {
    this._scheduled = false;
    if (!this._queue.length) return;
    const queue = this._queue;
    this._queue = [];
    const fragment = document.createDocumentFragment();
    for (const ev of queue) {
      if (ev.seq <= this.lastSeq) continue; // already shown: never twice
      this.lastSeq = ev.seq;
      this._apply(ev, fragment);
    }
    appendPinned(this.scroller, this.list, fragment);
    this.info.lastSeq = this.lastSeq;
    // a cancelling call is still running: its tool ignored the cancellation and can still act
    this.info.running = [...this.tools.values()].filter((t) => ["running", "cancelling"].includes(t.status)).length;
    if (this.onChange) this.onChange(this.info);
  }

  // -- rows ------------------------------------------------------------------------------------------------------

  _row(ev, cls, label, ...body) {
    const head = h(
      "div",
      { class: "row-head" },
      h("span", { class: "who", text: label }),
      h("time", { class: "time", datetime: ev.at, text: clock(ev.at) }),
      h("span", { class: "seq", text: `#${ev.seq}` }),
    );
    return h("li", { class: `row ${cls}`, dataset: { seq: ev.seq, type: ev.type } }, head, ...body);
  }

  _minor(ev) {
    return h(
      "li",
      { class: "row minor", dataset: { seq: ev.seq, type: ev.type } },
      h("span", { class: "seq", text: `#${ev.seq}` }),
      h("time", { class: "time", datetime: ev.at, text: clock(ev.at) }),
      h("code", { class: "type", text: ev.type }),
      h("span", { class: "summary", text: summary(ev) }),
    );
  }

  _apply(ev, fragment) {
    const d = ev.data || {};
    let row = null;
    switch (ev.type) {
      case "session.started":
        this.info.agent = d.agent;
        row = this._row(ev, "session", "Session started", h("p", { text: `Agent ${d.agent}` }));
        break;
      case "session.recovered":
        this.info.agent = d.agent;
        row = this._recovered(ev);
        break;
      case "session.closed":
        this.info.state = "closed";
        row = this._row(ev, "session", d.reason ? `Session closed (${d.reason})` : "Session closed");
        break;
      case "session.failed":
        this.info.state = "failed";
        row = this._row(
          ev,
          "session error",
          "Session failed",
          h("p", { text: d.reason || "No reason was given." }),
          d.agent ? h("p", { class: "muted", text: `Agent ${d.agent}` }) : null,
        );
        break;
      case "agent.state":
        this.info.agentState = d.state;
        break;
      case "agent.handoff":
        this.info.agent = d.to_agent;
        row = this._row(ev, "handoff", "Handoff", h("p", { text: `${d.from_agent ?? "—"} → ${d.to_agent}` }));
        break;
      case "user.input":
        if (d.final && d.item_id) this.inputs.set(d.item_id, d.text || "");
        if (d.final) {
          const role = d.role && d.role !== "user" ? d.role : "User";
          row = this._row(ev, "user", role[0].toUpperCase() + role.slice(1), h("p", { class: "text", text: d.text }));
        }
        break;
      case "speech.created":
        row = this._speechRow(ev);
        break;
      case "generation.started": {
        this.activeSpeech = d.speech_id;
        const sp = this.speeches.get(d.speech_id);
        if (sp && d.step > 0) sp.split = true; // a step after tool calls: its words go below those calls
        this._speechState(d.speech_id, "thinking");
        break;
      }
      case "speech.started":
        this.activeSpeech = d.speech_id;
        this._speechState(d.speech_id, "speaking");
        break;
      case "chat.item":
        row = this._chatItem(ev);
        break;
      case "speech.interrupted":
        this._interrupted(d.speech_id, d.played_text);
        break;
      case "speech.done":
        if (d.interrupted) this._interrupted(d.speech_id, null);
        else this._speechState(d.speech_id, "done");
        if (this.activeSpeech === d.speech_id) this.activeSpeech = null;
        break;
      case "generation.failed":
        row = this._row(ev, "error", "Generation failed", h("p", { text: d.error || "" }));
        break;
      case "tool.started":
        row = this._toolRow(ev);
        break;
      case "tool.progress":
        this._progress(ev);
        break;
      case "tool.cancelling":
        this._cancelling(ev);
        break;
      case "tool.ended":
        this._ended(ev);
        break;
      case "operator.action":
        row = this._operatorRow(ev);
        break;
      case "session.taken_over":
        row = this._row(
          ev,
          "session takeover",
          `Taken over by ${d.operator}`,
          h("p", { text: "The agent is asked for nothing until it is handed back." }),
          d.displaced ? h("p", { class: "muted", text: `Taken from ${d.displaced}` }) : null,
        );
        break;
      case "session.handed_back":
        row = this._row(
          ev,
          "session takeover",
          `Handed back by ${d.by || d.operator}`,
          h("p", { text: d.reply_speech_id ? "The agent answers the user's last input." : "The agent has it again." }),
        );
        break;
      case "session.coached":
        row = this._row(ev, "coach", "Coaching note", h("p", { class: "text", text: (ev.data || {}).note || "" }));
        break;
      default:
        break;
    }
    fragment.append(row || this._minor(ev));
  }

  /** The audit trail: who did what (the row's time is when), under which Idempotency-Key. */
  _operatorRow(ev) {
    const d = ev.data || {};
    const tool = d.call_id ? this.tools.get(d.call_id) : null;
    const what = {
      input: d.item_id && this.inputs.has(d.item_id) ? `sent “${truncate(this.inputs.get(d.item_id), 80)}”` : "sent input",
      say: "had the agent say something",
      interrupt: "interrupted the agent",
      cancel_tool: `cancelled the tool call ${tool ? tool.name : d.call_id}`,
      close: "closed the session",
      takeover: d.displaced ? `took the session over from ${d.displaced}` : "took the session over",
      takeover_say: "spoke as the agent",
      handback: "handed the session back",
      coach: "coached the agent",
      schedule: "scheduled a command",
      cancel_scheduled: "cancelled a scheduled command",
    }[d.action];
    const text = `${what || d.action}${d.force ? " (forced)" : ""}`;
    const key = d.idempotency_key ? h("p", { class: "muted small", text: `Idempotency-Key ${d.idempotency_key}` }) : null;
    const row = this._row(ev, "operator", `Operator ${d.actor}`, h("p", { class: "text", text }), key);
    row.dataset.action = d.action;
    return row;
  }

  _recovered(ev) {
    const d = ev.data || {};
    const notes = [];
    if (d.interrupted_calls?.length) notes.push(`${d.interrupted_calls.length} running tool call(s) ended interrupted`);
    if (d.retried_calls?.length) notes.push(`${d.retried_calls.length} tool call(s) re-run`);
    if (d.resumed_calls?.length) notes.push(`${d.resumed_calls.length} tool call(s) resumed`);
    if (d.interrupted_speeches?.length) notes.push(`${d.interrupted_speeches.length} speech(es) cut off`);
    const text = `Session recovered after a restart${notes.length ? ` — ${notes.join(", ")}` : ""}`;
    return h(
      "li",
      { class: "row divider", role: "separator", "aria-label": text, dataset: { seq: ev.seq, type: ev.type } },
      h("span", { class: "divider-text", text }),
      h("span", { class: "seq", text: `#${ev.seq}` }),
    );
  }

  // -- speeches --------------------------------------------------------------------------------------------------

  _speechRow(ev) {
    const d = ev.data || {};
    const state = h("span", { class: "badge state", text: "queued" });
    const source = d.source && d.source !== "reply" ? d.source.replace("_", " ") : null;
    const sp = { id: d.speech_id, state, segments: [], interrupted: false, split: false, fetching: false };
    const segment = this._segment(ev, sp);
    segment.row.querySelector(".row-head").append(state);
    if (source) segment.row.querySelector(".who").after(h("span", { class: "meta", text: source }));
    this.speeches.set(d.speech_id, sp);
    return segment.row;
  }

  /** A speech is one row, plus a continuation row for what it says after each of its tool calls. */
  _segment(ev, sp) {
    const heard = h("span", { class: "heard" });
    const gap = document.createTextNode("");
    const srNote = h("span", { class: "sr-only", hidden: true, text: "not heard: " });
    const rest = h("del", { class: "unheard", hidden: true });
    const continued = sp.segments.length > 0;
    const text = h("p", { class: "text speech-text" }, heard, gap, srNote, rest);
    const row = this._row(ev, "speech", continued ? "Agent (continued)" : "Agent", text);
    row.dataset.speechId = sp.id;
    const segment = { row, heard, gap, srNote, rest, parts: [] };
    sp.segments.push(segment);
    return segment;
  }

  _speechState(id, state) {
    const sp = this.speeches.get(id);
    if (!sp || sp.interrupted) return;
    if (state === "speaking" || state === "thinking") this._followLive(sp);
    else this._stopLive(sp);
    sp.state.textContent = state;
    for (const seg of sp.segments) seg.row.dataset.state = state;
    const first = sp.segments[0];
    if (state === "done" && sp.segments.every((seg) => !seg.parts.length)) {
      first.heard.textContent = "(nothing was said)";
      first.heard.classList.add("muted");
    }
  }

  _chatItem(ev) {
    const item = (ev.data || {}).item || {};
    if (item.type !== "message" || item.role !== "assistant") return null;
    const sp = this.activeSpeech ? this.speeches.get(this.activeSpeech) : null;
    if (!sp) {
      // an assistant message without a speech we know of (e.g. replayed from before the console's view)
      const cls = item.interrupted ? "speech interrupted" : "speech";
      return this._row(ev, cls, "Agent", h("p", { class: "text", text: item.text }));
    }
    let row = null;
    let seg = sp.segments.at(-1);
    if (sp.split) {
      sp.split = false; // a later step of the speech: continue below its tool calls
      seg = this._segment(ev, sp);
      row = seg.row;
    }
    seg.parts.push(item.text);
    seg.heard.textContent = seg.parts.join(" ");
    return row;
  }

  /**
   * While a speech is generated and played, show what the model has said so far (GET .../speeches/{id}, polled),
   * below what is committed; the committed message replaces it when the step ends.
   */
  _followLive(sp) {
    if (sp.liveTimer || !this.fetchSpeech) return;
    sp.live = h("p", { class: "live-text", "aria-live": "off" });
    sp.segments.at(-1).row.append(sp.live);
    sp.liveHeard = h("span", { class: "live-heard" });
    sp.liveRest = h("span", { class: "live-rest muted" });
    sp.live.append(sp.liveHeard, sp.liveRest);
    const poll = () =>
      this.fetchSpeech(sp.id).then(
        (info) => {
          if (!sp.live) return;
          // what the steps before committed is shown above; below it, this step: heard so far, then the rest
          const committed = sp.segments.flatMap((seg) => seg.parts).join(" ");
          const generated = (info.text || "").slice(committed.length).trim();
          const heard = (info.heard_text ?? info.played_text ?? "").slice(committed.length).trim();
          const split = splitHeard(generated, heard);
          sp.liveHeard.textContent = split.heard;
          sp.liveRest.textContent = split.rest ? `${split.heard ? " " : ""}${split.rest} …` : "";
        },
        () => {},
      );
    poll();
    sp.liveTimer = setInterval(poll, LIVE_POLL_MS);
  }

  /** Stop following live text (the view is closed). */
  stop() {
    for (const sp of this.speeches.values()) this._stopLive(sp);
  }

  _stopLive(sp) {
    clearInterval(sp.liveTimer);
    sp.liveTimer = null;
    if (sp.live) sp.live.remove();
    sp.live = null;
  }

  _interrupted(id, playedText) {
    const sp = this.speeches.get(id);
    if (!sp) return;
    this._stopLive(sp);
    const last = sp.segments.at(-1);
    if (!sp.interrupted) {
      sp.interrupted = true;
      sp.state.textContent = "interrupted";
      for (const seg of sp.segments) {
        seg.row.classList.add("interrupted");
        seg.row.dataset.state = "interrupted";
        seg.heard.classList.remove("muted");
      }
    }
    const single = sp.segments.length === 1;
    if (single && playedText !== null && playedText !== undefined) this._heard(sp, playedText);
    if (sp.fetching || !this.fetchSpeech) return;
    sp.fetching = true;
    // the events carry only what was heard; the speech resource also has everything that was generated
    this.fetchSpeech(id).then(
      (speech) => {
        const { heard, rest } = splitHeard(speech.text, speech.played_text);
        if (single) this._heard(sp, heard); // the unheard rest is always the tail of the last segment
        last.rest.textContent = rest;
        last.gap.data = rest && last.heard.textContent ? " " : "";
        last.rest.hidden = !rest;
        last.srNote.hidden = !rest;
        last.row.dataset.unheard = rest ? "yes" : "no";
      },
      () => {
        sp.fetching = false;
      },
    );
  }

  /** What an interrupted speech's single segment shows as heard: nothing heard is said so (nothing is committed
   * for it in the chat, as for a speech that said nothing). */
  _heard(sp, text) {
    const first = sp.segments[0];
    const none = !text && sp.segments.every((seg) => !seg.parts.length);
    first.heard.textContent = none ? "(interrupted before any words were heard)" : text;
    first.heard.classList.toggle("muted", none);
  }

  // -- tool calls ------------------------------------------------------------------------------------------------

  _toolRow(ev) {
    const d = ev.data || {};
    const status = h("span", { class: "badge status status-running", text: "running" });
    const args = h("pre", { class: "args", text: JSON.stringify(d.arguments ?? {}, null, 0) });
    const progressLine = h("div", { class: "progress-line", hidden: true });
    const output = h("pre", { class: "output", hidden: true });
    const actions = h("div", { class: "actions" });
    const row = this._row(
      ev,
      "tool",
      "Tool",
      h("p", { class: "tool-title" }, h("code", { class: "tool-name", text: d.name })),
      args,
      progressLine,
      output,
      actions,
    );
    row.dataset.callId = d.call_id;
    row.dataset.status = "running";
    row.querySelector(".row-head").append(status);
    const tool = {
      row,
      status: "running",
      statusEl: status,
      progressLine,
      bar: null,
      message: null,
      output,
      actions,
      name: d.name,
      cancel: null,
    };
    if (d.cancellable && !this.readOnly) {
      tool.cancel = h("button", {
        type: "button",
        class: "secondary small cancel",
        text: "Cancel",
        "aria-label": `Cancel tool call ${d.name} (${d.call_id})`,
      });
      tool.cancel.addEventListener("click", () => this.onCancel(d.call_id, tool.cancel));
      actions.append(tool.cancel);
    }
    this.tools.set(d.call_id, tool);
    return row;
  }

  _progress(ev) {
    const d = ev.data || {};
    const tool = this.tools.get(d.call_id);
    if (!tool) return;
    if (!tool.bar) {
      tool.bar = h("progress", { max: "1", "aria-label": `Progress of ${tool.name}` });
      tool.message = h("span", { class: "progress-msg" });
      tool.progressLine.append(tool.bar, tool.message);
      tool.progressLine.hidden = false;
    }
    if (typeof d.progress === "number") {
      tool.bar.value = d.progress;
      tool.bar.setAttribute("aria-valuetext", `${Math.round(d.progress * 100)}% — ${d.message || ""}`);
    } else {
      tool.bar.removeAttribute("value"); // indeterminate
    }
    tool.message.textContent = d.message || "";
  }

  _setStatus(tool, status) {
    tool.status = status;
    tool.row.dataset.status = status;
    tool.statusEl.textContent = status;
    tool.statusEl.className = `badge status status-${status}`;
  }

  /** Cancelled, but its tool ignores cancellation: still running until it returns (then tool.ended). */
  _cancelling(ev) {
    const d = ev.data || {};
    const tool = this.tools.get(d.call_id);
    if (!tool) return;
    this._setStatus(tool, "cancelling");
    if (tool.cancel) {
      tool.cancel.remove();
      tool.cancel = null;
    }
  }

  _ended(ev) {
    const d = ev.data || {};
    const tool = this.tools.get(d.call_id);
    if (!tool) return;
    this._setStatus(tool, d.status);
    if (tool.bar && d.status === "completed") tool.bar.value = 1;
    if (d.output) {
      tool.output.textContent = truncate(d.output, OUTPUT_MAX);
      tool.output.hidden = false;
      tool.output.classList.toggle("error", Boolean(d.is_error));
    }
    if (d.error) {
      // why it failed (redacted); the model was given only the output above
      tool.output.textContent = truncate(`${d.output ? `${d.output}\n` : ""}${d.error}`, OUTPUT_MAX);
      tool.output.hidden = false;
    }
    if (tool.cancel) {
      tool.cancel.remove();
      tool.cancel = null;
    }
  }
}
