// Speaking the agent in the browser: the Web Speech API when it has a voice that really speaks, else a timed
// stand-in (words per second) that reports progress the same way, so the session behaves as with real audio.
//
// Text is spoken clause by clause as it arrives (a Chunker cuts it); a clause reports, as it is spoken, how many of
// its characters have been spoken to the end of a word.

export const TIMED_WORDS_PER_S = 2.5;
const VOICES_WAIT_MS = 1000; // voices load asynchronously; none by then means none
const SILENT_AFTER_MS = 2500; // an utterance that has not started by then is not going to

const CLAUSE_END = /[.!?;:,]+["')\]]*\s+|\n\s*/g;
const MAX_CLAUSE = 240;

/** Cuts text that arrives in deltas into clauses {start, text}, each as soon as it is complete. */
export class Chunker {
  constructor() {
    this.text = "";
    this.cut = 0;
  }

  feed(delta) {
    this.text += delta;
    const clauses = [];
    for (;;) {
      CLAUSE_END.lastIndex = this.cut;
      const found = CLAUSE_END.exec(this.text);
      let end;
      if (found) end = found.index + found[0].length;
      else if (this.text.length - this.cut > MAX_CLAUSE) {
        end = this.text.lastIndexOf(" ", this.cut + MAX_CLAUSE) + 1;
        if (end <= this.cut) end = this.text.length;
      } else return clauses;
      clauses.push({ start: this.cut, text: this.text.slice(this.cut, end) });
      this.cut = end;
    }
  }

  flush() {
    const rest = this.text.slice(this.cut);
    const start = this.cut;
    this.cut = this.text.length;
    return rest ? [{ start, text: rest }] : [];
  }
}

/** Where each word of `text` ends (an index just past it). */
export function wordEnds(text) {
  return [...text.matchAll(/\S+/g)].map((m) => m.index + m[0].length);
}

/** The length of `text` in Unicode code points, as the service counts characters (JS strings count UTF-16 units). */
export function codePoints(text) {
  let n = 0;
  for (const _ of text) n += 1;
  return n;
}

export class Speaker {
  /** `onMode(mode, note)`: "voice" with the voice's name, or "timed" with why there is no voice. */
  constructor({ onMode, wordsPerSecond = TIMED_WORDS_PER_S }) {
    this.onMode = onMode;
    this.wordsPerSecond = wordsPerSecond;
    this.mode = null;
    this.voice = null;
    this._cancel = null;
  }

  /** Decide once how to speak: a voice of this browser, or timed progress. */
  async ready() {
    if (this.mode) return this.mode;
    const synth = globalThis.speechSynthesis;
    if (!synth || typeof globalThis.SpeechSynthesisUtterance !== "function") {
      return this._timed("This browser has no speech synthesis");
    }
    let voices = synth.getVoices();
    if (!voices.length) {
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, VOICES_WAIT_MS);
        synth.addEventListener("voiceschanged", () => (clearTimeout(timer), resolve()), { once: true });
      });
      voices = synth.getVoices();
    }
    if (!voices.length) return this._timed("This browser has no speech voice");
    this.voice = voices.find((v) => v.default) || voices.find((v) => v.lang?.startsWith("en")) || voices[0];
    this.mode = "voice";
    this.onMode("voice", `Speaking with the browser's voice “${this.voice.name}”.`);
    return this.mode;
  }

  _timed(why) {
    this.mode = "timed";
    this.voice = null;
    this.onMode(
      "timed",
      `${why}: the agent's words are shown at ${this.wordsPerSecond} words per second instead of spoken, ` +
        "and progress is timed the same way.",
    );
    return this.mode;
  }

  /** Speak one clause; `onWord(end)` as each word is spoken; resolves when it is done or cancelled. */
  speak(text, onWord) {
    return this.mode === "voice" ? this._speakVoice(text, onWord) : this._speakTimed(text, onWord);
  }

  /** Silence now: the clause being spoken resolves at once and reports nothing more. */
  cancel() {
    const cancel = this._cancel;
    this._cancel = null;
    if (cancel) cancel();
  }

  _speakVoice(text, onWord) {
    const ends = wordEnds(text);
    return new Promise((resolve) => {
      const utterance = new SpeechSynthesisUtterance(text);
      utterance.voice = this.voice;
      let started = false;
      let done = false;
      const settle = () => {
        done = true;
        clearTimeout(timer);
        this._cancel = null;
      };
      const silent = () => {
        // the voice exists but says nothing (no audio service behind it): time this clause and the rest
        if (done) return;
        settle();
        speechSynthesis.cancel();
        this._timed("The browser's speech voice stayed silent");
        resolve(this._speakTimed(text, onWord));
      };
      const timer = setTimeout(() => started || silent(), SILENT_AFTER_MS);
      utterance.onstart = () => {
        started = true;
      };
      utterance.onboundary = (ev) => {
        if (done || (ev.name && ev.name !== "word")) return;
        started = true;
        // every word that ends before the word now starting has been spoken
        const spoken = ends.filter((end) => end <= ev.charIndex).pop();
        if (spoken) onWord(spoken);
      };
      utterance.onend = () => {
        if (done) return;
        if (!started) return silent();
        settle();
        if (ends.length) onWord(ends[ends.length - 1]);
        resolve();
      };
      utterance.onerror = () => {
        if (done) return;
        if (!started) return silent();
        settle(); // cut off by the audio system: what was reported stands
        resolve();
      };
      this._cancel = () => {
        settle();
        speechSynthesis.cancel();
        resolve();
      };
      speechSynthesis.speak(utterance);
    });
  }

  _speakTimed(text, onWord) {
    const ends = wordEnds(text);
    const stepMs = 1000 / this.wordsPerSecond;
    return new Promise((resolve) => {
      let i = 0;
      let timer = null;
      const next = () => {
        if (i >= ends.length) {
          this._cancel = null;
          return resolve();
        }
        timer = setTimeout(() => {
          onWord(ends[i]);
          i += 1;
          next();
        }, stepMs);
      };
      this._cancel = () => {
        clearTimeout(timer);
        resolve();
      };
      next();
    });
  }
}
