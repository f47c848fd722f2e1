"""Event streams: a session's log and the multi-session stream over WebSocket (``events``), and a session as AG-UI
events over Server-Sent Events (``agui_routes``, translated by ``agui``); with what they share: a session's replay
joined to its live events (``session_stream``), frames encoded once for every subscriber (``ws_protocol``) and sent
from the hub's publish (``direct_send``), and the bound on open streams (``stream_slots``)."""
