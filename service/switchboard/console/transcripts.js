// What the Talk panel keeps from one media connection to the next: the final transcripts the session has not yet
// said it took, and the numbers of its connection attempts under one edge id.
//
// A closed connection does not tell an edge whether the final transcript it had just sent was taken (the node may
// have died with it unread or after committing it, the session may have moved as it arrived). So each one carries a
// fresh id and is kept until a `transcript.taken` names it; every new connection sends the kept ones again first, in
// order, with the same ids, and the session takes each at most once (docs/media-edge.md).

export const PENDING_LIMIT = 100; // a service that never answers must not grow the page without end
export const RESEND_CODE = "command_failed"; // the service could not apply it this time: send it again in a moment
export const WAIT_CODE = "rate_limited"; // over the credential's transcript budget: send it again after retry_after_s
export const DROP_CODES = new Set(["transcript_id_reused", "text_too_long"]); // sending it again cannot help

function randomBytes(n) {
  // getRandomValues, not randomUUID: the console may be served over plain http on another host (no secure context)
  return crypto.getRandomValues(new Uint8Array(n));
}

/** A version 4 UUID. */
export function uuid4() {
  const b = randomBytes(16);
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/** 16 random bytes as 22 URL-safe base64 characters. */
function base64Url(bytes) {
  return btoa(String.fromCharCode(...bytes))
    .replace(/\+/g, "-")
    .replace(/\//g, "_")
    .replace(/=+$/, "");
}

// one edge id per page load, its connection attempts numbered 1, 2, 3, ... across every panel of the page: the service
// refuses an attempt that is not newer than the latest it has seen from this edge (a stale one delivered late)
const EDGE_ID = base64Url(randomBytes(16));
let attempts = 0;

/** The query parameters of the next connection attempt. */
export function nextAttempt() {
  attempts += 1;
  return { edge_id: EDGE_ID, connection: String(attempts) };
}

/** The final transcripts sent and not yet taken, oldest first, at most `limit` of them. */
export class PendingTranscripts {
  constructor(limit = PENDING_LIMIT) {
    this.limit = limit;
    this._kept = new Map(); // id -> text, in the order they were said
  }

  /** A new final transcript, kept until taken: {id, dropped}, `dropped` the oldest one given up for room, if any. */
  add(text) {
    const id = uuid4();
    this._kept.set(id, text);
    let dropped = null;
    if (this._kept.size > this.limit) {
      const [oldId, oldText] = this._kept.entries().next().value;
      this._kept.delete(oldId);
      dropped = { id: oldId, text: oldText };
    }
    return { id, dropped };
  }

  pending() {
    return Array.from(this._kept, ([id, text]) => ({ id, text }));
  }

  get(id) {
    return this._kept.get(id);
  }

  /** Forget it (taken, or refused for good); true if it was kept. */
  discard(id) {
    return this._kept.delete(id);
  }
}
