// An operator's takeover in the session view: take the session over, type as the agent, hand it back.
//
// While the session is held the model is asked for nothing: the user's input shows in the timeline, and what is typed
// here is spoken as the agent (POST .../takeover/say). The console that holds the session sends a heartbeat
// (POST .../takeover again) so that the session does not show up in the attention queue as held by a quiet operator.

import { newKey } from "./api.js";
import { h } from "./dom.js";

const HEARTBEAT_MS = 20_000;

function clockOf(iso) {
  const at = new Date(iso);
  return Number.isNaN(at.getTime()) ? iso : at.toLocaleTimeString();
}

export class TakeoverPanel {
  /**
   * @param {object} o
   * @param {string} o.path   the session's path, /v1/sessions/{sid}
   * @param {object} o.api    the REST client
   * @param {(name, button, method, path, body, describe) => Promise<object|null>} o.command   the view's command runner
   * @param {(message: string) => void} o.showError
   * @param {() => Error|null} o.lastError   the error of the view's last failed command
   */
  constructor({ path, api, command, showError, lastError }) {
    this.lastError = lastError;
    this.path = path;
    this.api = api;
    this.command = command;
    this.showError = showError;
    this.holder = null; // the session's takeover, as last read: {operator, since, ...} or null
    this.mine = false; // this console took it over (and keeps it alive)
    this._timer = null;
    this.element = this._render();
    this.show(null);
  }

  _render() {
    this.status = h("p", { class: "takeover-status", role: "status", "aria-live": "polite" });
    this.takeButton = h("button", {
      type: "button",
      id: "op-takeover",
      class: "warn",
      text: "Take over",
      title: "Speak for the agent yourself: the model is asked for nothing until you hand it back",
    });
    this.takeButton.addEventListener("click", () => this.take(this.takeButton, false));
    this.forceButton = h("button", {
      type: "button",
      id: "op-takeover-force",
      class: "danger",
      hidden: true,
      text: "Take it over anyway",
      title: "Another operator holds this session: take it from them",
    });
    this.forceButton.addEventListener("click", () => this.take(this.forceButton, true));
    this.backButton = h("button", {
      type: "button",
      id: "op-handback",
      text: "Hand back",
      title: "Give the session back to the agent; it answers the user's last input if nobody did",
    });
    this.backButton.addEventListener("click", () => this.handBack(this.backButton));
    this.text = h("textarea", {
      id: "op-takeover-text",
      rows: "2",
      placeholder: "Type what the agent says…",
      "aria-describedby": "op-takeover-help",
    });
    this.sayButton = h("button", { type: "submit", class: "primary", id: "op-takeover-say", text: "Speak as agent" });
    this.form = h(
      "form",
      { class: "composer takeover-composer", "aria-label": "Speak as the agent", hidden: true },
      h("label", { for: "op-takeover-text", class: "sr-only", text: "What the agent says" }),
      this.text,
      h("div", { class: "composer-row" }, h("span", { class: "spacer" }), this.sayButton),
      h("p", {
        id: "op-takeover-help",
        class: "muted small",
        text: "Your words are spoken as the agent and marked as yours. Ctrl+Enter speaks.",
      }),
    );
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.say(this.sayButton);
    });
    this.text.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        this.say(this.sayButton);
      }
    });
    return h(
      "section",
      { class: "takeover", "aria-label": "Operator takeover" },
      h(
        "div",
        { class: "session-actions", role: "group", "aria-label": "Takeover" },
        this.status,
        h("span", { class: "spacer" }),
        this.takeButton,
        this.forceButton,
        this.backButton,
      ),
      this.form,
    );
  }

  /** Show who holds the session (`takeover` of a session read, or null: the agent has it). */
  show(takeover) {
    this.holder = takeover || null;
    const held = Boolean(this.holder);
    this.element.dataset.held = held ? "true" : "false";
    this.status.textContent = held
      ? `Held by ${this.holder.operator} since ${clockOf(this.holder.since)}: the agent is asked for nothing.`
      : "The agent has the session.";
    this.takeButton.hidden = held;
    this.backButton.hidden = !held;
    this.form.hidden = !held;
    if (held) this.forceButton.hidden = true;
    if (!held) this._stopHeartbeat();
  }

  async take(button, force) {
    const res = await this.command(force ? "takeover-force" : "takeover", button, "POST", `${this.path}/takeover`, {
      force,
    }, "Taking the session over");
    if (res && res.operator) {
      this.mine = true;
      this.show(res);
      this._startHeartbeat();
      this.text.focus();
    } else if (!force && this.lastError()?.code === "held_by_other") {
      this.forceButton.hidden = false;
    }
  }

  async say(button) {
    const text = this.text.value.trim();
    if (!text) {
      this.showError("Type what the agent should say first.");
      return;
    }
    const res = await this.command("takeover-say", button, "POST", `${this.path}/takeover/say`, { text }, "Speaking");
    if (res && this.text.value.trim() === text) this.text.value = "";
  }

  async handBack(button) {
    const res = await this.command("handback", button, "DELETE", `${this.path}/takeover`, null, "Handing back");
    if (res && res.operator) {
      this.mine = false;
      this.show(null);
    }
  }

  _startHeartbeat() {
    this._stopHeartbeat();
    this._timer = setInterval(() => this._beat(), HEARTBEAT_MS);
  }

  _stopHeartbeat() {
    clearInterval(this._timer);
    this._timer = null;
  }

  async _beat() {
    if (!this.mine || !this.holder) return;
    try {
      // a fresh key each time: a replayed answer would not reach the session, and it is the sign of life that counts
      await this.api.post(`${this.path}/takeover`, { force: false }, newKey());
    } catch {
      this._stopHeartbeat(); // taken from us or handed back elsewhere: the next session read shows who holds it
    }
  }

  stop() {
    this._stopHeartbeat();
  }
}
