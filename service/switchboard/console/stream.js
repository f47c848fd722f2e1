// Event streams over WebSocket that resume where they left off.
//
// SessionStream follows one session's gap-free log: it remembers the last seq it delivered, reconnects with
// since=<last seq> (at once after a 4008 "too slow", with back-off after a network drop), drops any frame it
// already delivered and reconnects if it ever sees a gap, so the consumer gets every event exactly once, in order.

const BACKOFF_MS = [250, 500, 1000, 2000, 3000];
const FATAL = {
  4400: "The event stream rejected the request.",
  4403: "This credential may not read this session's events.",
  4404: (sid) => `No session '${sid}'.`, // worded as the API words it
};

export class SessionStream {
  /**
   * @param {object} o
   * @param {string} o.sid
   * @param {(path: string) => string} o.wsUrl
   * @param {(fresh: boolean) => Promise<string|null>} o.token  a per-session token, or null when auth is off
   * @param {(events: object[]) => void} o.onEvents
   * @param {(state: string, detail?: string) => void} o.onState  connecting | live | reconnecting | ended | failed
   */
  constructor({ sid, wsUrl, token, onEvents, onState }) {
    this.sid = sid;
    this.wsUrl = wsUrl;
    this.token = token;
    this.onEvents = onEvents;
    this.onState = onState;
    this.lastSeq = 0;
    this.ws = null;
    this.connects = 0;
    this.duplicates = 0;
    this.gaps = 0;
    this.slowCloses = 0;
    this._attempt = 0;
    this._authRetried = false;
    this._stopped = false;
    this._timer = null;
    this._pending = [];
    this._flushQueued = false;
  }

  start() {
    this._connect();
    return this;
  }

  stop() {
    this._stopped = true;
    clearTimeout(this._timer);
    const ws = this.ws;
    this.ws = null;
    if (ws) ws.close(1000, "bye");
  }

  async _connect() {
    if (this._stopped) return;
    this.onState(this.connects ? "reconnecting" : "connecting");
    let token = null;
    try {
      token = await this.token(this._authRetried); // after a 4401: a fresh token
    } catch (err) {
      if (err.status === 401 || err.status === 403 || err.status === 404) return this._fail(err.message);
      return this._retryLater();
    }
    if (this._stopped) return;
    const params = new URLSearchParams({ since: String(this.lastSeq) });
    if (token) params.set("token", token);
    const ws = new WebSocket(this.wsUrl(`/v1/sessions/${encodeURIComponent(this.sid)}/events?${params}`));
    this.ws = ws;
    this.connects += 1;
    ws.onopen = () => {
      if (this.ws !== ws) return;
      this._attempt = 0;
      this.onState("live");
    };
    ws.onmessage = (msg) => this._onFrame(ws, msg.data);
    ws.onclose = (ev) => this._onClose(ws, ev);
  }

  _onFrame(ws, data) {
    if (this.ws !== ws) return; // a socket we already gave up on
    let ev;
    try {
      ev = JSON.parse(data);
    } catch {
      return;
    }
    if (typeof ev.seq !== "number") return; // pong
    if (ev.seq <= this.lastSeq) {
      this.duplicates += 1;
      return;
    }
    if (ev.seq !== this.lastSeq + 1) {
      this.gaps += 1; // never expected from a gap-free log: resume from what we have
      this.ws = null;
      ws.close(4000, "gap");
      this._connectSoon(0);
      return;
    }
    this.lastSeq = ev.seq;
    this._authRetried = false;
    this._pending.push(ev);
    if (!this._flushQueued) {
      this._flushQueued = true;
      queueMicrotask(() => {
        this._flushQueued = false;
        const batch = this._pending;
        this._pending = [];
        if (batch.length) this.onEvents(batch);
      });
    }
  }

  _onClose(ws, ev) {
    if (this.ws !== ws) return;
    this.ws = null;
    if (this._stopped) return;
    if (ev.code === 1000 && ev.reason === "session closed") {
      this.onState("ended");
      return;
    }
    if (ev.code === 4008) {
      this.slowCloses += 1; // we fell behind; the service kept everything: resume from our last seq at once
      this._connectSoon(0);
      return;
    }
    if (ev.code === 4401 && !this._authRetried) {
      this._authRetried = true; // the token may have expired: fetch a new one once
      this._connectSoon(0);
      return;
    }
    if (ev.code === 4401) return this._fail("The session token is invalid or has expired.");
    const fatal = FATAL[ev.code];
    if (fatal) return this._fail(typeof fatal === "function" ? fatal(this.sid) : fatal);
    this._retryLater();
  }

  _fail(message) {
    this._stopped = true;
    this.onState("failed", message);
  }

  _retryLater() {
    const delay = BACKOFF_MS[Math.min(this._attempt, BACKOFF_MS.length - 1)];
    this._attempt += 1;
    this.onState("reconnecting");
    this._connectSoon(delay);
  }

  _connectSoon(delay) {
    clearTimeout(this._timer);
    this._timer = setTimeout(() => {
      if (this.ws === null) this._connect();
    }, delay);
  }
}

/**
 * The multi-session stream for the session list: starts at the live tail (cursor=now), after a ping/pong round
 * trip proves the subscription exists, so a snapshot loaded then misses nothing. Resumes by cursor.
 */
export class MultiStream {
  constructor({ wsUrl, types, onReady, onEvent, onState }) {
    this.wsUrl = wsUrl;
    this.types = types;
    this.onReady = onReady;
    this.onEvent = onEvent;
    this.onState = onState;
    this.cursor = null;
    this.ws = null;
    this._attempt = 0;
    this._stopped = false;
    this._timer = null;
  }

  start() {
    this._connect();
    return this;
  }

  stop() {
    this._stopped = true;
    clearTimeout(this._timer);
    if (this.ws) this.ws.close(1000, "bye");
    this.ws = null;
  }

  _connect() {
    if (this._stopped) return;
    const params = new URLSearchParams({ cursor: this.cursor === null ? "now" : String(this.cursor) });
    if (this.types) params.set("types", this.types);
    const ws = new WebSocket(this.wsUrl(`/v1/events?${params}`));
    const fresh = this.cursor === null;
    let ready = !fresh;
    this.ws = ws;
    ws.onopen = () => {
      this._attempt = 0;
      if (fresh) ws.send(JSON.stringify({ type: "ping" }));
      else this.onState("live");
    };
    ws.onmessage = (msg) => {
      if (this.ws !== ws) return;
      const frame = JSON.parse(msg.data);
      if (frame.type === "pong") {
        if (!ready) {
          ready = true;
          this.onReady(); // load the snapshot now: every later change arrives on this socket
          this.onState("live");
        }
        return;
      }
      if (typeof frame.cursor === "number") {
        if (this.cursor !== null && frame.cursor <= this.cursor) return;
        this.cursor = frame.cursor;
      }
      this.onEvent(frame);
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (this._stopped) return;
      if (ev.code === 4401 || ev.code === 4403) {
        this._stopped = true;
        this.onState("unauthorized");
        return;
      }
      const delay = ev.code === 4008 ? 0 : BACKOFF_MS[Math.min(this._attempt++, BACKOFF_MS.length - 1)];
      this.onState("reconnecting");
      this._timer = setTimeout(() => this._connect(), delay);
    };
  }
}
