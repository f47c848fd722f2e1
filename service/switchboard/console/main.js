// Entry point: credentials, routing by URL fragment, and wiring of the overview and the session view.
//
//   /console/                                  overview; pick a session
//   /console/#session=<sid>                    a session, with the API key of this tab (if auth is on)
//   /console/#session=<sid>&token=<sbt_...>    embedded, read-only, with a per-session token (a tab that
//                                              holds an API key keeps it and ignores the token)
//
// The fragment never reaches the server; the API key lives only in sessionStorage.

import { Api } from "./api.js";
import { AttentionQueue } from "./attention.js";
import { ClusterPanel } from "./cluster.js";
import { NewSession } from "./new_session.js";
import { Overview } from "./overview.js";
import { SessionView } from "./session_view.js";

const $ = (id) => document.getElementById(id);

function route() {
  const params = new URLSearchParams(location.hash.slice(1));
  return { sid: params.get("session"), token: params.get("token") };
}

const initial = route();
const api = new Api({ token: initial.token });
// A link's token never replaces the API key this tab already holds: a link from anyone would otherwise turn an
// operator's tab into a read-only view of whatever session the link's author chose, under the author's credential.
const ignoredToken = Boolean(initial.token && api.apiKey);
if (ignoredToken) api.token = null;
const app = { api, overview: null, view: null, attention: null, cluster: null, newSession: null };
window.switchboard = app; // for debugging and for the browser tests

function notice(message) {
  const box = $("notice");
  box.textContent = message;
  box.hidden = !message;
}

function authUi() {
  const hasKey = Boolean(api.apiKey);
  $("auth-state").textContent = api.readOnly ? "Read-only (session token)" : hasKey ? "Using an API key" : "";
  $("auth-forget").hidden = !hasKey || api.readOnly;
  $("auth-open").hidden = api.readOnly;
}

function askForKey(message) {
  if (api.readOnly) return;
  $("auth-form").hidden = false;
  if (message) notice(message);
  $("auth-key").focus();
}

function onError(err, prefix) {
  if (err.status === 401)
    return askForKey(api.apiKey ? "That API key was not accepted." : "This service needs an API key.");
  notice(prefix ? `${prefix}: ${err.message}` : err.message);
}

function openSession(sid) {
  if (app.view && app.view.sid === sid) return;
  if (app.view) app.view.stop();
  app.view = null;
  if (app.overview) app.overview.select(sid);
  const root = $("session-view");
  if (!sid) {
    root.replaceChildren(placeholder.cloneNode(true));
    return;
  }
  app.view = new SessionView({ root, api, sid });
  app.view.start();
  document.title = `${sid} — Switchboard console`;
  app.view.title.focus({ preventScroll: true });
}

function restart() {
  // credentials changed: reload both views with them
  notice("");
  authUi();
  if (app.overview) app.overview.stop();
  if (app.attention) app.attention.stop();
  if (app.cluster) app.cluster.stop();
  app.overview = embedded ? null : new Overview(overviewParts).start();
  app.attention = embedded ? null : new AttentionQueue(attentionParts).start();
  app.cluster = embedded ? null : new ClusterPanel(clusterParts).start();
  const sid = app.view?.sid ?? route().sid;
  if (app.view) app.view.stop();
  app.view = null;
  openSession(sid);
}

const embedded = api.readOnly;
const placeholder = $("session-view").firstElementChild.cloneNode(true); // what the view shows with no session
const overviewParts = {
  api,
  sessionsBody: $("sessions"),
  sessionsEmpty: $("sessions-empty"),
  toolsList: $("running-tools"),
  toolsEmpty: $("tools-empty"),
  status: $("list-status"),
  onError,
  filter: $("session-filter"),
  sortHeads: [...document.querySelectorAll("table.sessions th[data-sort]")],
};
const attentionParts = {
  api,
  list: $("attention"),
  empty: $("attention-empty"),
  missing: $("attention-missing"),
  count: $("attention-count"),
  onError,
};

const clusterParts = { api, section: $("cluster"), body: $("cluster-nodes"), count: $("cluster-count") };

api.onUnauthorized = () => askForKey(api.apiKey ? "That API key was not accepted." : "This service needs an API key.");

$("auth-open").addEventListener("click", () => askForKey(""));
$("auth-cancel").addEventListener("click", () => {
  $("auth-form").hidden = true;
});
$("auth-forget").addEventListener("click", () => {
  api.setApiKey(null);
  restart();
});
$("auth-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("auth-key").value.trim();
  if (!key) return;
  api.setApiKey(key);
  $("auth-key").value = "";
  $("auth-form").hidden = true;
  restart();
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && !$("auth-form").hidden) $("auth-form").hidden = true;
  shortcut(e);
});

// Keys for the controls used under pressure; never while typing, never with a modifier.
function shortcut(e) {
  const typing = e.target.closest?.("input, textarea, select, [contenteditable]");
  if (typing || e.ctrlKey || e.metaKey || e.altKey || embedded) return;
  const go = (ids, step) => {
    if (!ids.length) return;
    const at = ids.indexOf(app.view?.sid);
    location.hash = `session=${encodeURIComponent(ids[(at + step + ids.length) % ids.length])}`;
  };
  const actions = {
    "/": () => $("op-text")?.focus(),
    i: () => $("op-interrupt-now")?.click(),
    j: () => go(app.overview?.visibleIds() ?? [], 1),
    k: () => go(app.overview?.visibleIds() ?? [], -1),
    g: () => go(app.attention?.ids() ?? [], 1),
  };
  const action = actions[e.key];
  if (!action) return;
  e.preventDefault();
  action();
}
window.addEventListener("hashchange", () => openSession(route().sid));

if (embedded) document.body.classList.add("embedded");
authUi();
if (ignoredToken) notice("This link carried a session token; this tab goes on with its own API key.");
if (!embedded) {
  app.newSession = new NewSession({
    api,
    toggle: $("new-session-open"),
    form: $("new-session-form"),
    agent: $("new-session-agent"),
    about: $("new-session-about"),
    text: $("new-session-text"),
    submit: $("new-session-start"),
    cancel: $("new-session-cancel"),
    error: $("new-session-error"),
    onOpen: (sid) => {
      location.hash = `session=${encodeURIComponent(sid)}`;
      app.overview?.refresh(); // listed now, not at the next poll
    },
    onError,
  });
  app.overview = new Overview(overviewParts).start();
  app.attention = new AttentionQueue(attentionParts).start();
  app.cluster = new ClusterPanel(clusterParts).start();
}
openSession(initial.sid);
