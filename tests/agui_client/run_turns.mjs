// Runs turns against a Switchboard AG-UI endpoint with the stock HttpAgent and prints what the client saw, as JSON:
// {"runs": [{"events": [...], "messages": [...], "error": null | "<message>"}]}
// usage: node run_turns.mjs <url> <threadId> <text> [<text> ...]   (AGUI_HEADERS: extra headers, as JSON)
import { HttpAgent } from "@ag-ui/client";

const [url, threadId, ...texts] = process.argv.slice(2);
const headers = JSON.parse(process.env.AGUI_HEADERS ?? "{}");
const agent = new HttpAgent({ url, threadId, headers });
const runs = [];
for (const [i, text] of texts.entries()) {
  agent.addMessage({ id: `user-${threadId}-${i}`, role: "user", content: text });
  const events = [];
  let error = null;
  try {
    await agent.runAgent({ runId: `run-${threadId}-${i}` }, { onEvent: ({ event }) => void events.push(event) });
  } catch (err) {
    error = String(err?.message ?? err);
  }
  runs.push({ events, messages: structuredClone(agent.messages), error });
  if (error !== null) break;
}
process.stdout.write(JSON.stringify({ runs }));
