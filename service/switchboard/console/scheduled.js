// Commands at a point of the conversation and coaching, in the session view: the "when" choice beside the inject box
// (now, when idle, after the current speech, after a tool call), the Coach box (a note for the agent's next reply
// only, never shown to the user), and the list of what is pending, each with a Cancel button.

import { h, truncate } from "./dom.js";

// events after which the pending list is read again
export const SCHEDULED_EVENTS = new Set([
  "scheduled.created",
  "scheduled.applied",
  "scheduled.cancelled",
  "session.coached",
  "session.closed",
]);

const POINTS = [
  ["now", "Now"],
  ["idle", "When idle"],
  ["after_speech", "After the current speech"],
  ["after_tool", "After tool call…"],
];

const POINT_LABELS = { idle: "when idle", after_speech: "after the speech", next_turn: "next reply" };

/** The "when" choice: a select, and the call id it asks for after a tool call. */
export class WhenChoice {
  constructor() {
    this.select = h(
      "select",
      { id: "op-when", "aria-label": "When it applies" },
      ...POINTS.map(([value, label]) => h("option", { value, text: label })),
    );
    this.callId = h("input", {
      id: "op-when-call",
      type: "text",
      placeholder: "call id",
      "aria-label": "The tool call to wait for",
      hidden: true,
      spellcheck: "false",
    });
    this.select.addEventListener("change", () => {
      this.callId.hidden = this.select.value !== "after_tool";
      if (!this.callId.hidden) this.callId.focus();
    });
    this.element = h(
      "label",
      { for: "op-when", class: "when" },
      "Apply ",
      this.select,
      " ",
      this.callId,
    );
  }

  /** The body's `when`: null for now; throws when a tool call is asked for without its id. */
  value() {
    const at = this.select.value;
    if (at === "now") return null;
    if (at !== "after_tool") return { at };
    const callId = this.callId.value.trim();
    if (!callId) throw new Error("Type the id of the tool call to wait for.");
    return { at, call_id: callId };
  }

  /** Back to "now" once a scheduled command was accepted (the next one is for now unless chosen again). */
  reset() {
    this.select.value = "now";
    this.callId.value = "";
    this.callId.hidden = true;
  }
}

/** The Coach box and the pending list. ``command(name, button, method, path, body, describe)`` runs a command
 * (the session view's: one Idempotency-Key per intention, errors in plain words). */
export class CoachBox {
  constructor({ api, path, command }) {
    this.api = api;
    this.path = path;
    this.command = command;
    this.note = h("textarea", {
      id: "op-coach",
      rows: "2",
      placeholder: "A note for the agent's next reply only (the user never sees it)…",
      "aria-describedby": "op-coach-help",
    });
    const send = h("button", { type: "submit", id: "op-coach-send", text: "Coach" });
    this.status = h("p", { id: "op-coach-status", class: "muted small", role: "status", "aria-live": "polite" });
    const form = h(
      "form",
      { class: "coach", "aria-label": "Coach the agent" },
      h("label", { for: "op-coach", text: "Coach" }),
      this.note,
      h("div", { class: "composer-row" }, h("span", { class: "spacer" }), send),
      h("p", {
        id: "op-coach-help",
        class: "muted small",
        text: "Given to the model with its next request, then gone; recorded in the audit trail.",
      }),
      this.status,
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.coach(send);
    });
    this.list = h("ul", { id: "op-scheduled", class: "scheduled-list", "aria-label": "Pending commands" });
    this.empty = h("p", { class: "muted small", id: "op-scheduled-empty", text: "Nothing is scheduled." });
    this.element = h(
      "section",
      { class: "scheduled", "aria-label": "Coaching and scheduled commands" },
      form,
      h("h3", { text: "Pending" }),
      this.list,
      this.empty,
    );
  }

  async coach(button) {
    const note = this.note.value.trim();
    if (!note) return;
    const res = await this.command("coach", button, "POST", `${this.path}/coach`, { note }, "Coaching");
    if (!res) return;
    if (this.note.value.trim() === note) this.note.value = "";
    this.status.textContent = "Note left for the agent's next reply.";
    this.refresh();
  }

  async cancel(id, button) {
    const path = `${this.path}/scheduled/${encodeURIComponent(id)}`;
    if (await this.command(`unschedule:${id}`, button, "DELETE", path, null, "Cancelling")) this.refresh();
  }

  /** Read the pending commands again (after an event about them); a failed read keeps what is shown. */
  async refresh() {
    let items;
    try {
      items = (await this.api.get(`${this.path}/scheduled?pending_only=true`)).items || [];
    } catch {
      return;
    }
    this.list.replaceChildren(...items.map((it) => this._item(it)));
    this.empty.hidden = items.length > 0;
  }

  _item(it) {
    const what = it.kind === "coach" ? `Note: ${it.args.note}` : `${it.kind} ${it.args.text ? `“${it.args.text}”` : ""}`;
    const point = it.at === "after_tool" ? `after ${it.call_id}` : POINT_LABELS[it.at] || it.at;
    const cancel = h("button", { type: "button", class: "secondary small cancel-scheduled", text: "Cancel" });
    cancel.addEventListener("click", () => this.cancel(it.id, cancel));
    return h(
      "li",
      { dataset: { id: it.id, kind: it.kind } },
      h("span", { class: "what", text: truncate(what, 120) }),
      " ",
      h("span", { class: "muted small", text: point }),
      " ",
      cancel,
    );
  }
}
