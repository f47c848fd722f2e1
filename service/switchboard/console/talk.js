// The "Talk" panel: this browser becomes the session's media edge (WS /v1/sessions/{sid}/media). It speaks the
// agent's speeches (Web Speech API, or timed progress without a voice) and reports playback.started / progress /
// finished; the operator types (or, where the browser recognises speech, speaks) as the user, and "User starts
// talking" barges in. Connecting replaces any other edge of the session, so it happens only on request.
//
// A 4410 ("not active here") is what an edge gets during a drain or a failover, a 1012 ("service restart") when
// the service stops gracefully, and a 1013 ("try again later") while its database is unavailable: the session goes on
// in a moment, here or on another node. The panel then connects again by itself, a few times with a growing pause (a
// fresh token each time), and says so; any other close code ends the connection as before, and the operator connects
// again if they want to.
//
// Each final transcript carries an id and is kept until the session answers `transcript.taken` for it: every new
// connection sends the ones still kept first, in order, whatever closed the last one (transcripts.js). Every connect
// URL carries this page's edge id and the attempt's number.

import { h } from "./dom.js";
import { Chunker, codePoints, Speaker } from "./speaker.js";
import { DROP_CODES, nextAttempt, PendingTranscripts, RESEND_CODE, WAIT_CODE } from "./transcripts.js";

const CLOSE_NOTES = {
  1000: "The session has closed.",
  4401: "The service did not accept the credential.",
  4403: "This credential may not connect as the session's media edge (it needs the media:connect scope).",
  4404: "No such session.",
  4409: "Another edge connected to this session and replaced this browser.",
  4410: "The session is not active here (ended, being recovered or moved): connect again in a moment.",
  4429: "This browser sent too many frames per second.",
  1006: "The connection to the service was lost or could not be made.",
  1012: "The service is restarting.",
  1013: "The service could not reach its database: connect again in a moment.",
};
const RECONNECT_CODES = new Set([4410, 1012, 1013]);
// the close codes that end a reconnection too: the session, the credential or this edge's place is gone for good
const FINAL_CODES = new Set([1000, 4401, 4403, 4404, 4409, 4429]);
// about two minutes of pauses: a failover takes a few seconds, but a restart on a busy host (drain, stop, start,
// recover) took over 35 s, and an operator would rather wait than connect again by hand
const RETRY_DELAYS_MS = [500, 1000, 2000, 4000, ...Array(14).fill(8000)];
// a connection that stayed open this long held: a later 4410 starts a fresh round of attempts
const HELD_MS = 10000;
const RESEND_AFTER_MS = 1000; // a transcript the service failed to apply (command_failed) is sent again after this
const MAX_WAIT_MS = 60000; // the longest pause a rate_limited refusal's retry_after_s is taken at its word for

/** One speech (or one segment of it, after a tool step): its text as it arrives, its clauses, what was heard. */
class Playback {
  constructor(id, allowInterruptions) {
    this.id = id;
    this.allowInterruptions = allowInterruptions;
    this.chunker = new Chunker();
    this.clauses = [];
    this.ended = false;
    this.stopped = false;
    this.started = false;
    this.heard = 0; // UTF-16 index into the text: spoken to the end of a word up to here
    this._wake = null;
  }

  get text() {
    return this.chunker.text;
  }

  add(delta) {
    this.clauses.push(...this.chunker.feed(delta));
    this._poke();
  }

  end() {
    this.clauses.push(...this.chunker.flush());
    this.ended = true;
    this._poke();
  }

  stop() {
    this.stopped = true;
    this._poke();
  }

  _poke() {
    const wake = this._wake;
    this._wake = null;
    if (wake) wake();
  }

  /** The next clause to speak, waiting for text; null at the end or once stopped. */
  async next() {
    while (!this.clauses.length && !this.ended && !this.stopped) await new Promise((r) => (this._wake = r));
    return this.stopped ? null : (this.clauses.shift() ?? null);
  }
}

export class TalkPanel {
  constructor({ api, sid }) {
    this.api = api;
    this.sid = sid;
    this.ws = null;
    this.queue = [];
    this.current = null;
    this._pumping = false;
    this._epoch = 0; // bumped by a disconnect: a connection attempt of an older epoch gives up when it resumes
    this._retry = null; // {attempt, timer} while reconnecting after a 4410
    this._openedAt = null;
    this.transcripts = new PendingTranscripts(); // across this panel's connections
    this.speaker = new Speaker({ onMode: (mode, note) => this._voiceNote(mode, note) });
    this.element = this._render();
  }

  stop() {
    this.disconnect();
  }

  // -- connection ------------------------------------------------------------------------------------------------

  async connect() {
    if (this.ws || this._retry) return;
    const epoch = this._epoch;
    this.connectButton.disabled = true;
    this._state("connecting", "Connecting…");
    await this.speaker.ready();
    if (epoch === this._epoch) this._open(epoch);
  }

  disconnect() {
    const ws = this.ws;
    this.ws = null;
    this._epoch += 1;
    this._cancelRetry();
    this._silence();
    if (ws) ws.close(1000, "bye");
    this._setConnected(false);
    this._state("idle", "Not connected.");
  }

  async _open(epoch) {
    this._openedAt = null;
    let token = null;
    try {
      token = await this._token();
    } catch (err) {
      if (epoch !== this._epoch) return;
      const why = `Could not connect: ${err.message}`;
      // the service unreachable or unavailable is part of a restart: keep trying; a refused credential is not
      if (this._retry && (err.status === 0 || err.status >= 500)) return this._again(why);
      return this._failed("failed", why);
    }
    if (epoch !== this._epoch) return;
    const query = `?${new URLSearchParams({ ...(token ? { token } : {}), ...nextAttempt() })}`;
    const ws = new WebSocket(this.api.wsUrl(`/v1/sessions/${encodeURIComponent(this.sid)}/media${query}`));
    this.ws = ws;
    ws.onopen = () => {
      if (this.ws !== ws) return;
      this._openedAt = performance.now();
      this._state("connected", "Connected: the agent speaks here.");
      this._setConnected(true);
      // no answer on an earlier connection: taken or not, the session takes each of them once
      for (const kept of this.transcripts.pending()) this._sendTranscript(kept.id, kept.text);
    };
    ws.onmessage = (msg) => this.ws === ws && this._onFrame(msg.data);
    ws.onclose = (ev) => this.ws === ws && this._closed(ev);
  }

  async _token() {
    if (this.api.readOnly || !this.api.apiKey) return this.api.token; // auth off: no token needed
    const path = `/v1/sessions/${encodeURIComponent(this.sid)}/tokens`;
    return (await this.api.post(path, { scopes: ["media:connect"] })).token;
  }

  _closed(ev) {
    this.ws = null;
    this._silence();
    const why = CLOSE_NOTES[ev.code] || `Disconnected (${ev.code}${ev.reason ? `: ${ev.reason}` : ""}).`;
    if (this._openedAt !== null && performance.now() - this._openedAt >= HELD_MS) this._retry = null;
    // a 4410, 1012 or 1013 starts reconnecting; then only a final code stops it (an unreachable service does not)
    if (RECONNECT_CODES.has(ev.code) || (this._retry && !FINAL_CODES.has(ev.code))) return this._again(why);
    this._failed(ev.code === 1000 ? "idle" : "failed", why);
  }

  /** The next reconnection after a pause, or the end of them after the last attempt. */
  _again(why) {
    const attempt = (this._retry?.attempt ?? 0) + 1;
    const last = RETRY_DELAYS_MS.length;
    if (attempt > last) return this._failed("failed", `${why} Gave up reconnecting after ${last} attempts.`);
    const delay = RETRY_DELAYS_MS[attempt - 1];
    const epoch = this._epoch;
    const timer = setTimeout(() => {
      if (epoch !== this._epoch) return;
      this._retry.timer = null;
      this._state("reconnecting", `Reconnecting (attempt ${attempt} of ${last})… ${why}`);
      this._open(epoch);
    }, delay);
    this._retry = { attempt, timer };
    this._setConnected(false, true);
    this._state("reconnecting", `Reconnecting in ${delay / 1000} s (attempt ${attempt} of ${last}). ${why}`);
    this.status.dataset.attempt = String(attempt);
  }

  _cancelRetry() {
    if (this._retry?.timer) clearTimeout(this._retry.timer);
    this._retry = null;
  }

  _failed(state, why) {
    this._cancelRetry();
    this._setConnected(false);
    this._state(state, why);
  }

  _send(frame) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(frame));
  }

  // -- the service's frames --------------------------------------------------------------------------------------

  _onFrame(raw) {
    let frame;
    try {
      frame = JSON.parse(raw);
    } catch {
      return;
    }
    const byId = (id) => [this.current, ...this.queue].filter((p) => p && p.id === id).pop();
    const latest = byId(frame.speech_id);
    if (frame.type === "speech.start") {
      this.queue.push(new Playback(frame.speech_id, frame.allow_interruptions !== false));
      this._pump();
    } else if (frame.type === "speech.text" && latest) {
      latest.add(typeof frame.delta === "string" ? frame.delta : "");
      if (latest === this.current) this._showSpeech(latest);
    } else if (frame.type === "speech.end" && latest) {
      latest.end();
    } else if (frame.type === "speech.stop") {
      this._stopSpeech(frame.speech_id);
    } else if (frame.type === "transcript.taken" && typeof frame.id === "string") {
      if (this.transcripts.discard(frame.id)) this._markTranscript(frame.id, "taken");
    } else if (frame.type === "error") {
      this._log("note", `The service refused a frame: ${frame.code}: ${frame.detail || ""}`);
      if (typeof frame.id === "string") this._refused(frame.id, frame.code, frame.retry_after_s);
    }
  }

  // -- playing ---------------------------------------------------------------------------------------------------

  async _pump() {
    if (this._pumping) return;
    this._pumping = true;
    try {
      while (this.queue.length) {
        this.current = this.queue.shift();
        await this._play(this.current);
        this.current = null;
      }
    } finally {
      this._pumping = false;
    }
  }

  async _play(pb) {
    this._showSpeech(pb);
    for (let clause = await pb.next(); clause; clause = await pb.next()) {
      if (!pb.started) {
        pb.started = true;
        this._send({ type: "playback.started", speech_id: pb.id });
        // positions are reported: a speech cut before its first word is heard as nothing, not as all it was sent
        this._send({ type: "playback.progress", speech_id: pb.id, played_chars: 0 });
        this._showSpeech(pb);
      }
      await this.speaker.speak(clause.text, (end) => this._heard(pb, clause.start + end));
      if (pb.stopped) return;
    }
    if (pb.stopped) return;
    if (!pb.started) this._send({ type: "playback.started", speech_id: pb.id });
    this._heard(pb, pb.text.length);
    this._finish(pb, false);
  }

  _heard(pb, end) {
    if (pb.stopped || end <= pb.heard) return;
    pb.heard = end;
    this._send({ type: "playback.progress", speech_id: pb.id, played_chars: codePoints(pb.text.slice(0, end)) });
    this._showSpeech(pb);
  }

  _finish(pb, interrupted) {
    if (pb.finished) return;
    pb.finished = true;
    this._send({ type: "playback.finished", speech_id: pb.id, interrupted });
    this._showSpeech(pb, interrupted ? "interrupted" : "finished");
    const heard = pb.text.slice(0, pb.heard).trim();
    const entry = this._log(interrupted ? "agent interrupted" : "agent", interrupted ? "Agent (cut off): " : "Agent: ");
    entry.dataset.speechId = pb.id;
    entry.append(h("span", { class: "heard", text: heard }));
    if (interrupted) entry.append(h("span", { class: "unheard", text: ` ${pb.text.slice(pb.heard).trim()}` }));
  }

  /** Silence the speech(es) with this id now and report them cut off. */
  _stopSpeech(id) {
    for (const pb of [this.current, ...this.queue]) {
      if (!pb || pb.id !== id || pb.finished) continue;
      this._halt(pb);
      this._finish(pb, true);
    }
    this.queue = this.queue.filter((pb) => pb.id !== id);
  }

  _halt(pb) {
    pb.stop();
    if (pb === this.current) this.speaker.cancel();
  }

  _silence() {
    for (const pb of [this.current, ...this.queue]) if (pb) this._halt(pb);
    this.queue = [];
  }

  // -- the user --------------------------------------------------------------------------------------------------

  /** The user starts talking: like a phone that hears its user, stop the agent's audio here first (when the
   * speech allows it), so what was reported is exactly what was heard; then tell the service. */
  bargeIn() {
    const pb = this.current;
    const cut = pb && pb.started && pb.allowInterruptions && !pb.finished;
    if (cut) this._halt(pb);
    this._send({ type: "user.speech_started" });
    if (cut) this._finish(pb, true);
  }

  say(text, final = true) {
    if (!final) return this._send({ type: "user.transcript", text, final });
    const { id, dropped } = this.transcripts.add(text);
    const entry = this._log("user", "You: ");
    entry.dataset.transcriptId = id;
    entry.dataset.state = "sent";
    entry.append(h("span", { text }));
    if (dropped) this._dropped(dropped.id, `${this.transcripts.limit} transcripts were waiting for an answer`);
    this._sendTranscript(id, text);
  }

  _sendTranscript(id, text) {
    this._send({ type: "user.transcript", text, final: true, id });
  }

  /** The service did not take a final transcript: send it again in a moment (after the wait it named, when over
   * the credential's budget), or give it up. */
  _refused(id, code, retryAfterS) {
    const text = this.transcripts.get(id);
    if (text === undefined) return;
    if (code === RESEND_CODE || code === WAIT_CODE) {
      const named = code === WAIT_CODE && typeof retryAfterS === "number" && retryAfterS >= 0;
      const waitMs = named ? Math.min(retryAfterS * 1000, MAX_WAIT_MS) : RESEND_AFTER_MS;
      // on this connection if it still stands and the transcript is still waiting; else the next one sends it
      const ws = this.ws;
      const again = () => this.ws === ws && this.transcripts.get(id) !== undefined && this._sendTranscript(id, text);
      setTimeout(again, waitMs);
    } else if (DROP_CODES.has(code)) {
      this.transcripts.discard(id);
      this._dropped(id, code);
    }
  }

  _dropped(id, why) {
    this._markTranscript(id, "dropped");
    this._log("note", `A line was not taken and is given up (${why}).`);
  }

  _markTranscript(id, state) {
    const entry = this.logList.querySelector(`li[data-transcript-id="${id}"]`);
    if (entry) entry.dataset.state = state;
  }

  _listen() {
    const Recognition = globalThis.SpeechRecognition || globalThis.webkitSpeechRecognition;
    if (this.recognition) return this.recognition.stop();
    const rec = new Recognition();
    rec.interimResults = true;
    rec.continuous = true;
    rec.onspeechstart = () => this.bargeIn();
    rec.onresult = (ev) => {
      for (let i = ev.resultIndex; i < ev.results.length; i += 1) {
        const text = ev.results[i][0].transcript.trim();
        if (text) this.say(text, ev.results[i].isFinal);
      }
    };
    rec.onerror = (ev) => this._log("note", `Speech recognition stopped: ${ev.error}`);
    rec.onend = () => {
      this.recognition = null;
      this.micButton.textContent = "Speak";
      this.micButton.setAttribute("aria-pressed", "false");
    };
    this.recognition = rec;
    this.micButton.textContent = "Stop listening";
    this.micButton.setAttribute("aria-pressed", "true");
    rec.start();
  }

  // -- layout ----------------------------------------------------------------------------------------------------

  _render() {
    this.connectButton = h("button", { type: "button", id: "talk-connect", text: "Connect audio" });
    this.connectButton.addEventListener("click", () => (this.ws || this._retry ? this.disconnect() : this.connect()));
    this.status = h("span", { id: "talk-state", class: "conn", role: "status", "aria-live": "polite" });
    this.voice = h("p", { id: "talk-voice", class: "muted small" });
    this.speech = h("p", { id: "talk-speech", class: "talk-speech", "aria-live": "off" });
    this.logList = h("ol", { id: "talk-log", class: "talk-log", "aria-label": "What was said" });
    this.input = h("input", { id: "talk-text", type: "text", autocomplete: "off", placeholder: "Say as the user…" });
    this.sendButton = h("button", { type: "submit", id: "talk-send", class: "primary", text: "Send" });
    this.bargeButton = h("button", { type: "button", id: "talk-barge", class: "warn", text: "User starts talking" });
    this.bargeButton.addEventListener("click", () => this.bargeIn());
    this.micButton = h("button", { type: "button", id: "talk-mic", text: "Speak", "aria-pressed": "false" });
    this.micButton.hidden = !(globalThis.SpeechRecognition || globalThis.webkitSpeechRecognition);
    this.micButton.addEventListener("click", () => this._listen());
    const form = h(
      "form",
      { class: "talk-row", "aria-label": "Talk as the user" },
      h("label", { for: "talk-text", class: "sr-only", text: "What the user says" }),
      this.input,
      this.sendButton,
      this.micButton,
      this.bargeButton,
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const text = this.input.value.trim();
      if (!text || !this.ws) return;
      this.input.value = "";
      this.say(text);
    });
    this._setConnected(false);
    this._state("idle", "Not connected.");
    return h(
      "section",
      { class: "talk", id: "talk", "aria-labelledby": "talk-title" },
      h(
        "div",
        { class: "talk-row" },
        h("h3", { id: "talk-title", text: "Talk" }),
        this.connectButton,
        this.status,
      ),
      this.voice,
      this.speech,
      this.logList,
      form,
    );
  }

  /** `retrying`: not connected, but a reconnection is on its way (the button cancels it). */
  _setConnected(on, retrying = false) {
    this.connectButton.textContent = on || retrying ? "Disconnect audio" : "Connect audio";
    this.connectButton.disabled = false;
    for (const el of [this.input, this.sendButton, this.bargeButton, this.micButton]) el.disabled = !on;
  }

  _state(state, text) {
    if (state !== "reconnecting") delete this.status.dataset.attempt;
    this.status.dataset.state = state;
    this.status.textContent = text;
  }

  _voiceNote(mode, note) {
    this.voice.dataset.mode = mode;
    this.voice.textContent = note;
  }

  _showSpeech(pb, state) {
    const heard = pb.text.slice(0, pb.heard);
    this.speech.dataset.speechId = pb.id;
    this.speech.dataset.state = state || (pb.started ? "playing" : "waiting");
    this.speech.dataset.playedChars = String(codePoints(heard));
    this.speech.replaceChildren(
      h("span", { class: "heard", text: heard }),
      h("span", { class: state === "interrupted" ? "unheard" : "pending", text: pb.text.slice(pb.heard) }),
    );
  }

  _log(kind, label) {
    const entry = h("li", { class: kind }, h("strong", { text: label }));
    this.logList.append(entry);
    return entry;
  }
}
