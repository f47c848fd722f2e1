// "New session": pick an agent (GET /v1/agents), optionally a first message, and start it (POST /v1/sessions with
// the credential this tab holds, then POST .../input); the console then opens the new session.

import { Intent } from "./api.js";
import { h } from "./dom.js";

export class NewSession {
  /** `parts`: the form's elements by role; `onOpen(sid)` shows a session; `onError(err, prefix)` reports one. */
  constructor({ api, toggle, form, agent, about, text, submit, cancel, error, onOpen, onError }) {
    Object.assign(this, { api, toggle, form, agent, about, text, submit, cancel, error, onOpen, onError });
    this.createIntent = new Intent();
    this.inputIntent = new Intent();
    this.agents = new Map(); // name -> description
    toggle.addEventListener("click", () => (form.hidden ? this.show() : this.hide()));
    cancel.addEventListener("click", () => this.hide());
    agent.addEventListener("change", () => this._describe());
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this._start();
    });
    form.addEventListener("keydown", (e) => {
      if (e.key === "Escape") this.hide();
    });
  }

  async show() {
    this.form.hidden = false;
    this.toggle.setAttribute("aria-expanded", "true");
    this._say("");
    this.agent.focus();
    try {
      const { items } = await this.api.get("/v1/agents");
      const chosen = this.agent.value;
      this.agents = new Map(items.map((a) => [a.name, a.description || ""]));
      this.agent.replaceChildren(...items.map((a) => h("option", { value: a.name, text: a.name })));
      if (this.agents.has(chosen)) this.agent.value = chosen;
      this._describe();
    } catch (err) {
      if (err.status === 401) this.onError(err);
      else this._say(`Could not list the agents: ${err.message}`);
    }
  }

  hide() {
    this.form.hidden = true;
    this.toggle.setAttribute("aria-expanded", "false");
    this.toggle.focus();
  }

  _describe() {
    this.about.textContent = this.agents.get(this.agent.value) || "";
  }

  _say(message) {
    this.error.textContent = message;
    this.error.hidden = !message;
  }

  async _start() {
    const agent = this.agent.value;
    if (!agent || this.submit.disabled) return;
    const text = this.text.value.trim();
    this.submit.disabled = true;
    let sid = null;
    try {
      // one Idempotency-Key per intention: a double click or a retry starts one session
      const session = await this.api.post("/v1/sessions", { agent }, this.createIntent.key(agent));
      sid = session.id;
      const input = `/v1/sessions/${encodeURIComponent(sid)}/input`;
      if (text) await this.api.post(input, { text }, this.inputIntent.key(sid));
      this.text.value = "";
      this.hide();
      this.onOpen(sid);
    } catch (err) {
      if (err.status === 401) this.onError(err);
      else if (sid) {
        this.hide();
        this.onOpen(sid);
        this.onError(err, "The session started, but its first message was not sent");
      } else this._say(`Starting a session failed: ${err.message}`);
    } finally {
      this.submit.disabled = false;
    }
  }
}
