// REST client for the public Switchboard API: credentials, Idempotency-Key, plain-words errors.

const KEY_STORAGE = "switchboard.apiKey";
const RETRIES = 2;

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** A fresh idempotency key (crypto.randomUUID needs a secure context; fall back to getRandomValues). */
export function newKey() {
  if (globalThis.crypto?.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/**
 * One operator intention on one control. Clicking again with the same request within `windowMs` (a double click)
 * reuses the key, so the service applies it once; retries inside Api.request reuse it too.
 */
export class Intent {
  constructor(windowMs = 1500) {
    this.windowMs = windowMs;
    this._key = null;
    this._fingerprint = null;
    this._at = 0;
  }

  key(fingerprint) {
    const now = performance.now();
    if (!this._key || fingerprint !== this._fingerprint || now - this._at > this.windowMs) {
      this._key = newKey();
      this._fingerprint = fingerprint;
    }
    this._at = now;
    return this._key;
  }
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function plainMessage(status, problem) {
  if (problem && typeof problem.detail === "string" && problem.detail) return problem.detail;
  if (status === 401) return "The service needs a valid API key.";
  if (status === 403) return "This API key is not allowed to do that.";
  if (problem && problem.title) return problem.title;
  return `The service answered with HTTP ${status}.`;
}

export class Api {
  /** `token`: a per-session token from an embedding dashboard (read-only); otherwise the key in session storage. */
  constructor({ base = "", token = null } = {}) {
    this.base = base;
    this.token = token;
    this.onUnauthorized = null;
  }

  get apiKey() {
    try {
      return sessionStorage.getItem(KEY_STORAGE);
    } catch {
      return null;
    }
  }

  setApiKey(key) {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
  }

  get credential() {
    return this.token || this.apiKey;
  }

  get readOnly() {
    return Boolean(this.token);
  }

  /** The answer's JSON body; with `withHeaders`, `{body, headers}` (the response's Headers) instead. */
  async request(method, path, { body, idempotencyKey, retries = RETRIES, withHeaders = false } = {}) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (this.credential) headers.Authorization = `Bearer ${this.credential}`;
    if (idempotencyKey) headers["Idempotency-Key"] = idempotencyKey;
    // only reads and keyed commands are safe to send again
    const retryable = method === "GET" || Boolean(idempotencyKey);
    for (let attempt = 0; ; attempt += 1) {
      let res;
      try {
        res = await fetch(this.base + path, {
          method,
          headers,
          body: body === undefined ? undefined : JSON.stringify(body),
          cache: "no-store",
        });
      } catch {
        if (retryable && attempt < retries) {
          await sleep(200 * 2 ** attempt);
          continue;
        }
        throw new ApiError(0, "network", "Could not reach the Switchboard service. Check your connection and retry.");
      }
      if (res.status === 503 && retryable && attempt < retries) {
        const after = Number(res.headers.get("Retry-After")) || 0.5;
        await sleep(Math.min(after, 5) * 1000);
        continue;
      }
      if (res.status === 204) return withHeaders ? { body: null, headers: res.headers } : null;
      let payload = null;
      try {
        payload = await res.json();
      } catch {
        payload = null;
      }
      if (!res.ok) {
        const err = new ApiError(res.status, payload?.code || "http_error", plainMessage(res.status, payload));
        if (res.status === 401 && this.onUnauthorized) this.onUnauthorized(err);
        throw err;
      }
      return withHeaders ? { body: payload, headers: res.headers } : payload;
    }
  }

  get(path) {
    return this.request("GET", path);
  }

  post(path, body, idempotencyKey) {
    return this.request("POST", path, { body, idempotencyKey });
  }

  delete(path, idempotencyKey) {
    return this.request("DELETE", path, { idempotencyKey });
  }

  /** ws(s)://host + path; never carries the API key (a per-session token at most). */
  wsUrl(path) {
    const url = new URL(this.base + path, location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    return url.toString();
  }

  /** A token for one session's event stream: the embedded one, a fresh one from the API key, or none (auth off). */
  async sessionToken(sid) {
    if (this.token) return this.token;
    if (!this.apiKey) return null;
    const res = await this.post(`/v1/sessions/${encodeURIComponent(sid)}/tokens`, {});
    return res.token;
  }
}
