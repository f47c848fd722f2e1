"""`switchboard edge` with the real espeak-ng engine against a real server: what the session commits as heard is
where the audio was cut, word for word."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import wave
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.espeak_support import require_espeak

from .console_support import create_session, wait_until
from .media_relay import MediaRelay, RelayedConnection
from .media_support import KEY, KEYS, NO_MEDIA_KEY
from .server import Server

pytestmark = pytest.mark.e2e

LONG = (
    "Thank you for calling the station. Your train to Geneva leaves from platform seven at a quarter past nine, "
    "and it stops in Lausanne, Morges and Nyon before it arrives. Tickets can be bought on board or at the desk."
)
TIMEOUT_S = 30.0
HEARD_WORDS = 4  # of LONG's 40 when the speech is cut


@pytest.fixture(autouse=True)
def espeak_installed() -> None:
    require_espeak()


class Reachable(Protocol):
    @property
    def url(self) -> str: ...


class EdgeProcess:
    """`switchboard edge` in the background: stdin to write the user's lines, stdout read line by line."""

    def __init__(self, server: Reachable, sid: str, *extra: str, key: str | None = KEY) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
        env.update(SWITCHBOARD_URL=server.url, PYTHONUNBUFFERED="1", **({"SWITCHBOARD_KEY": key} if key else {}))
        cmd = [sys.executable, "-m", "switchboard.cli", "edge", sid, "--no-play", *extra]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, start: str, timeout: float = TIMEOUT_S) -> str:
        """The next stdout line that starts with `start` (earlier lines are kept in `seen`)."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line {start!r} from the edge; it printed {self.seen}") from None
            if line is None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"the edge ended before {start!r}: {self.seen}; stderr: {err}")
            self.seen.append(line)
            if line.startswith(start):
                return line

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[int, str]:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            code = self.proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return code, self.proc.stderr.read() if self.proc.stderr else ""


def speech(client: httpx.Client, sid: str, speech_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/sessions/{sid}/speeches/{speech_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def speech_done(client: httpx.Client, sid: str, speech_id: str) -> dict[str, Any]:
    """The speech once it has ended (committed)."""
    return dict(
        wait_until(
            lambda: (s := speech(client, sid, speech_id))["state"] == "done" and s, timeout=TIMEOUT_S, what="done"
        )
    )


def speaking(
    server: Server, client: httpx.Client, out: Path, *extra: str, turns: list[dict[str, Any]] | None = None
) -> tuple[str, EdgeProcess, str]:
    """A session whose edge (writing to `out`) is playing LONG, a few words in: (session, edge, speech)."""
    sid = create_session(client, turns or [])
    edge = EdgeProcess(server, sid, "--out", str(out), *extra)
    try:
        edge.expect("connected to session")
        speech_id = client.post(f"/v1/sessions/{sid}/say", json={"text": LONG}).json()["speech_id"]
        edge.expect(f"speech {speech_id} playing")
    except BaseException:
        edge.proc.kill()
        raise
    # the agent has been heard for a few words (as the edge reported them), and is far from the end
    wait_until(lambda: len(speech(client, sid, speech_id)["heard_text"].split()) >= HEARD_WORDS, timeout=TIMEOUT_S)
    return sid, edge, speech_id


def audio_of(out: Path, speech_id: str) -> tuple[dict[str, Any], int]:
    """The edge's record of a speech and the number of samples in its WAV file."""
    record = json.loads((out / f"{speech_id}.json").read_text())
    with wave.open(str(out / f"{speech_id}.wav")) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, record["sample_rate"])
        return record, wav.getnframes()


def heard_in(record: dict[str, Any], samples: int) -> str:
    """The text spoken to the end of a word within the first `samples` samples of the speech's audio."""
    chars = 0
    for word in record["words"]:
        if word["end_sample"] > samples:
            break
        chars = word["chars"]
    return str(record["text"][:chars])


def full_length(text: str) -> int:
    """How many samples espeak-ng makes of the whole text (the same engine, run here on its own)."""
    done = subprocess.run(["espeak-ng", "--stdout", "--stdin"], input=text.encode(), capture_output=True, check=True)
    return (len(done.stdout) - 44) // 2


def test_barge_in_mid_speech_commits_what_the_cut_audio_holds(
    media_srv: Server, media_client: httpx.Client, tmp_path: Path
) -> None:
    turns = [{"text": "Of course, go ahead."}]
    sid, edge, speech_id = speaking(media_srv, media_client, tmp_path, "--barge-in", turns=turns)
    try:
        edge.say("Sorry, which platform?")
        edge.expect(f"speech {speech_id} stopped after")
        done = speech_done(media_client, sid, speech_id)
        record, samples = audio_of(tmp_path, speech_id)

        # the file ends where the audio was cut, well before the end of the speech
        assert samples == record["played_samples"]
        assert 0 < samples < full_length(LONG) * 0.8
        # what the session committed as heard is exactly the words the cut audio holds, and what the edge reported
        heard = heard_in(record, samples)
        assert heard and len(heard) < len(LONG) and LONG.startswith(heard)
        assert done["interrupted"] is True
        assert done["played_text"] == heard == LONG[: record["reported_chars"]]
        assert record["interrupted"] is True
        chat = media_client.get(f"/v1/sessions/{sid}/chat").json()["items"]
        said = [i for i in chat if i["type"] == "message" and i["role"] == "assistant"]
        assert said[0]["text"] == heard and said[0]["interrupted"] is True
        # the line became the user's turn, and the agent's answer was played to its end
        assert [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"] == ["Sorry, which platform?"]
        reply = edge.expect("speech ")
        reply_id = reply.split()[1]
        edge.expect(f"speech {reply_id} finished")
        reply_record, reply_samples = audio_of(tmp_path, reply_id)
        assert reply_samples >= reply_record["words"][-1]["end_sample"] and not reply_record["interrupted"]
        answered = speech_done(media_client, sid, reply_id)
        assert answered["played_text"] == "Of course, go ahead." and answered["interrupted"] is False
        media_client.delete(f"/v1/sessions/{sid}")
        assert edge.expect("session ") == f"session {sid} closed"
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        code, err = edge.finish()
    assert code == 0, err


def test_an_interrupt_from_the_service_silences_the_edge_at_the_last_reported_word(
    media_srv: Server, media_client: httpx.Client, tmp_path: Path
) -> None:
    sid, edge, speech_id = speaking(media_srv, media_client, tmp_path)
    try:
        res = media_client.post(f"/v1/sessions/{sid}/interrupt", json={})
        assert res.status_code == 200 and res.json()["interrupted"] is True, res.text
        committed = speech(media_client, sid, speech_id)["played_text"]
        edge.expect(f"speech {speech_id} stopped after")
        record, samples = audio_of(tmp_path, speech_id)
        # the service committed the last progress the edge reported before the stop, never more than it played
        assert committed and LONG.startswith(committed)
        assert len(committed) <= record["reported_chars"] and record["words"]
        assert len(heard_in(record, samples)) == record["reported_chars"]
        assert samples < full_length(LONG) * 0.8
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        edge.finish()


def test_an_edge_without_the_media_scope_is_refused_in_one_line(media_srv: Server, media_client: httpx.Client) -> None:
    sid = create_session(media_client, [])
    edge = EdgeProcess(media_srv, sid, key=NO_MEDIA_KEY)
    code, err = edge.finish()
    assert code == 1
    assert err.startswith("switchboard: The media connection was refused (4403") and err.count("\n") == 1, err


def test_a_session_token_with_the_media_scope_is_enough_and_one_without_it_is_refused(
    media_srv: Server, media_client: httpx.Client
) -> None:
    sid = create_session(media_client, [])
    tokens = f"/v1/sessions/{sid}/tokens"
    reader = media_client.post(tokens, json={}).json()["token"]
    edge = EdgeProcess(media_srv, sid, "--token", reader, key=None)
    code, err = edge.finish()
    assert code == 1 and err.count("\n") == 1, err
    assert "refused (4403" in err and "lacks the media:connect scope" in err, err
    token = media_client.post(tokens, json={"scopes": ["media:connect"]}).json()["token"]
    edge = EdgeProcess(media_srv, sid, "--token", token, key=None)
    try:
        edge.expect("connected to session")
        speech_id = media_client.post(f"/v1/sessions/{sid}/say", json={"text": "With a token."}).json()["speech_id"]
        edge.expect(f"speech {speech_id} finished: 'With a token.'")
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        assert edge.finish()[0] == 0


def test_a_second_edge_replaces_the_first_which_says_so_and_exits(
    media_srv: Server, media_client: httpx.Client
) -> None:
    sid = create_session(media_client, [])
    first = EdgeProcess(media_srv, sid)
    first.expect("connected to session")
    second = EdgeProcess(media_srv, sid)
    try:
        second.expect("connected to session")
        first.proc.wait(TIMEOUT_S)  # on its own, its input still open
        code, err = first.finish()
        assert code == 1
        assert "replaced this one" in err and err.count("\n") == 1, err
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        assert second.finish()[0] == 0


def test_a_speech_with_a_tool_step_plays_as_segments_each_in_its_own_file(
    media_srv: Server, media_client: httpx.Client, tmp_path: Path
) -> None:
    turns = [
        {"text": "Let me book that for you.", "tool_calls": [{"name": "book", "arguments": {"what": "a table"}}]},
        {"text": "Done: {{tool_output:book}}."},
    ]
    sid = create_session(media_client, turns)
    edge = EdgeProcess(media_srv, sid, "--out", str(tmp_path))
    try:
        edge.expect("connected to session")
        speech_id = media_client.post(f"/v1/sessions/{sid}/input", json={"text": "A table, please."}).json()[
            "speech_id"
        ]
        edge.expect(f"speech {speech_id} finished: 'Let me book that for you.'")
        edge.expect(f"speech {speech_id} finished: 'Done: booked a table.'")
        first, first_samples = audio_of(tmp_path, speech_id)
        second, second_samples = audio_of(tmp_path, f"{speech_id}-2")
        assert (first["text"], second["text"]) == ("Let me book that for you.", "Done: booked a table.")
        assert first_samples >= first["words"][-1]["end_sample"] and second_samples >= second["words"][-1]["end_sample"]
        done = speech_done(media_client, sid, speech_id)
        assert done["interrupted"] is False
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        edge.finish()


def test_an_edge_stopped_mid_speech_writes_its_file_and_the_speech_ends_where_it_was_heard(
    media_srv: Server, media_client: httpx.Client, tmp_path: Path
) -> None:
    sid, edge, speech_id = speaking(media_srv, media_client, tmp_path)
    try:
        edge.proc.send_signal(signal.SIGTERM)
        code, err = edge.finish()
        assert code == 0, err
        record, samples = audio_of(tmp_path, speech_id)  # a complete WAV file, cut where the audio stopped
        assert record["interrupted"] is True and 0 < samples < full_length(LONG) * 0.8
        done = speech_done(media_client, sid, speech_id)
        # the service ended the speech at the last word the edge reported: the one the file ends after
        assert done["interrupted"] is True
        assert done["played_text"] == heard_in(record, samples) == LONG[: record["reported_chars"]]
    finally:
        media_client.delete(f"/v1/sessions/{sid}")


def test_a_voice_espeak_ng_does_not_have_is_one_line_before_connecting(media_srv: Server) -> None:
    edge = EdgeProcess(media_srv, "any-session", "--voice", "nosuchvoice")
    code, err = edge.finish()
    assert code == 2
    assert err.startswith("switchboard: espeak-ng exited with 1") and "voice does not exist" in err, err
    assert err.count("\n") == 1 and not edge.seen


def test_the_edge_reconnects_after_a_restart_and_plays_on(tmp_path: Path) -> None:
    server = Server(tmp_path, SWITCHBOARD_API_KEYS=KEYS).start()
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as api:
            sid = create_session(api, [])
            edge = EdgeProcess(server, sid, "--out", str(tmp_path))
            edge.expect("connected to session")
            server.stop()  # a graceful restart: the session is suspended, the edge told to come back
            server.start()
            edge.expect("connected to session")
            speech_id = api.post(f"/v1/sessions/{sid}/say", json={"text": "Back again."}).json()["speech_id"]
            edge.expect(f"speech {speech_id} finished: 'Back again.'")
            api.delete(f"/v1/sessions/{sid}")
        code, err = edge.finish()
        assert code == 0 and err.count("reconnecting") == 1, err
    finally:
        server.stop()


def transcripts(conn: RelayedConnection) -> list[dict[str, Any]]:
    return [f for f in conn.up if f["type"] == "user.transcript"]


def taken(conn: RelayedConnection) -> list[dict[str, Any]]:
    return [f for f in conn.down if f["type"] == "transcript.taken"]


def user_lines(client: httpx.Client, sid: str) -> list[str]:
    chat = client.get(f"/v1/sessions/{sid}/chat").json()["items"]
    return [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"]


def test_a_transcript_whose_answer_was_lost_is_sent_again_with_its_id_and_taken_once(
    media_srv: Server, media_client: httpx.Client
) -> None:
    """The connection is lost after the service took a line and before its `transcript.taken` reached the edge: the
    next connection sends it again first, with the same id, and the chat holds it once; a line that was answered is
    not sent again after the next drop, nor one the service refused for good. Every connection carries the edge's
    id and its attempt's number."""
    sid = create_session(media_client, [{"text": "Booked."}, {"text": "Noted."}])
    relay = MediaRelay(media_srv.ws_url).start()
    edge = EdgeProcess(relay, sid)
    try:
        edge.expect("connected to session")
        relay.lose_next_taken()
        edge.say("A table for four.")
        edge.expect("connected to session")  # the second connection, after the loss
        first, second = wait_until(lambda: relay.connections[:2] if len(relay.connections) >= 2 else None)
        [lost] = first.withheld
        [said] = transcripts(first)
        assert said["id"] == lost["id"] and said["text"] == "A table for four."
        [answer] = wait_until(lambda: taken(second), timeout=TIMEOUT_S, what="the answer on the second connection")
        assert transcripts(second)[0] == said  # sent again first, the same id and text
        assert (answer["id"], answer["item_id"]) == (lost["id"], lost["item_id"])  # taken once, answered twice
        assert user_lines(media_client, sid) == ["A table for four."]

        edge.say("x" * 8001)  # beyond the service's text limit: refused, given up, never sent again
        assert " dropped (text_too_long): 'xxx" in edge.expect("transcript ")
        relay.drop()  # answered or refused, then the connection is lost: nothing to send again
        edge.expect("connected to session")
        edge.say("By the window.")
        third = wait_until(lambda: relay.connections[2] if len(relay.connections) >= 3 else None)
        wait_until(lambda: taken(third), timeout=TIMEOUT_S, what="the answer on the third connection")
        [window] = transcripts(third)
        assert window["text"] == "By the window." and window["id"] != said["id"]
        assert user_lines(media_client, sid) == ["A table for four.", "By the window."]
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        edge.finish()
        relay.stop()
    queries = [parse_qs(urlsplit(c.path).query) for c in relay.connections]
    assert [q["connection"] for q in queries] == [["1"], ["2"], ["3"]]
    [edge_id] = {q["edge_id"][0] for q in queries}
    assert len(edge_id) == 22


def test_the_edge_exits_at_the_end_of_its_input_once_the_session_took_its_lines_and_it_played_its_speech(
    media_srv: Server, media_client: httpx.Client
) -> None:
    sid = create_session(media_client, [{"text": "Noted."}])
    edge = EdgeProcess(media_srv, sid)
    try:
        edge.expect("connected to session")
        said = {"text": "One moment please.", "allow_interruptions": False}  # the user's line does not cut it
        speech_id = media_client.post(f"/v1/sessions/{sid}/say", json=said).json()["speech_id"]
        edge.expect(f"speech {speech_id} playing")
        edge.say("A table for two.")
        code, err = edge.finish()  # stdin ends while the speech plays and before the line is answered
        assert code == 0, err
        assert edge.expect(f"speech {speech_id} ") == f"speech {speech_id} finished: 'One moment please.'"
        assert edge.expect("input ended") == f"input ended; left session {sid}"
        assert "A table for two." in user_lines(media_client, sid)
        assert speech_done(media_client, sid, speech_id)["interrupted"] is False
    finally:
        media_client.delete(f"/v1/sessions/{sid}")
        edge.proc.kill()
