// Small DOM and formatting helpers shared by the console's views.

/** Create an element: h("li", {class: "row", dataset: {seq: 3}, onclick: fn}, child, "text"). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "text") el.textContent = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child !== null && child !== undefined && child !== false) el.append(child);
  }
  return el;
}

/** "4s", "3m 07s", "2h 05m", "3d 4h" */
export function formatAge(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const hours = Math.floor(m / 60);
  if (hours < 24) return `${hours}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

const pad2 = (n) => (n < 10 ? `0${n}` : String(n));

/** Local wall-clock time of an ISO timestamp, HH:MM:SS (by hand: toLocaleTimeString is slow over 5,000 rows). */
export function clock(iso) {
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return "";
  return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}

/** Compact JSON for arguments: {"city": "Rome"} -> city="Rome". */
export function formatArgs(args) {
  if (!args || typeof args !== "object") return "";
  return Object.entries(args)
    .map(([k, v]) => `${k}=${JSON.stringify(v)}`)
    .join(", ");
}

export function truncate(text, max = 400) {
  if (typeof text !== "string") return "";
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/** Split a speech's generated text into what was heard and the rest, tolerating whitespace differences. */
export function splitHeard(text, played) {
  text = text || "";
  played = (played || "").trim();
  if (!played) return { heard: "", rest: text.trim() };
  let i = 0;
  let j = 0;
  while (i < text.length && j < played.length) {
    if (text[i] === played[j]) {
      i += 1;
      j += 1;
    } else if (/\s/.test(text[i])) {
      i += 1;
    } else if (/\s/.test(played[j])) {
      j += 1;
    } else {
      return { heard: played, rest: "" }; // the text is not what was played (should not happen): show what was heard
    }
  }
  return { heard: played, rest: j >= played.length ? text.slice(i).trim() : "" };
}

/** Append `rows` (built off-document) in one go, keeping the view pinned to the bottom if it was there. */
export function appendPinned(scroller, list, fragment) {
  const pinned = scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 48;
  list.append(fragment);
  if (pinned) scroller.scrollTop = scroller.scrollHeight;
}

/** Run `fn` on the next animation frame, or soon when the tab is hidden (frames are paused there). */
export function nextFrame(fn) {
  if (document.hidden) return setTimeout(fn, 16);
  return requestAnimationFrame(fn);
}
