"""Pieces of engine outputs as the HTTP API sends them: the streamable tail of the incremental text, each
token's text and bytes (OpenAI's ``tokens`` / ``bytes`` / ``text_offset``), and log-probs joined, shifted and
cut at stop strings, so streamed pieces join to exactly the non-streamed response.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import os
import threading
from typing import Any

from atomtool.serve.engine.detokenizer import IncrementalDetokenizer, decoder_for


def new_tail(text: str, sent: int, finished: bool) -> str:
    """The part of ``text`` after ``sent`` characters that may be streamed now (see module doc)."""
    delta = text[sent:]
    if not finished:
        delta = delta.rstrip("\ufffd")
    return delta


class StreamText:
    """One request's streamed text: the chunk each output adds (:func:`new_tail`), from a cumulative output
    (its text past what was sent) or a delta one (its text after the part of earlier ones not sent yet: a
    trailing U+FFFD waits, as for a cumulative output), so both give the same chunks."""

    def __init__(self) -> None:
        self.sent = 0  # characters streamed so far
        self.pending = ""  # delta outputs' text not streamed yet

    def next(self, out: Any) -> str:
        if getattr(out, "delta", False):
            text = self.pending + out.text
            chunk = new_tail(text, 0, out.finished)
            self.pending = text[len(chunk):]
        else:
            chunk = new_tail(out.text, self.sent, out.finished)
        self.sent += len(chunk)
        return chunk


def num_output_tokens(out: Any) -> int:
    """Tokens a request has generated so far (``RequestOutput.num_output_tokens``; an engine stand-in's
    output without it is cumulative: its ``token_ids``)."""
    n = getattr(out, "num_output_tokens", -1)
    return n if n >= 0 else len(out.token_ids)


def prompt_only_output(out: Any) -> Any:
    """An echo request with ``max_tokens`` 0 runs as a one-token request (vLLM's "echo without generation"):
    its output with that token dropped (no token ids, text or log-probs; 0 output tokens for usage) and
    finish_reason ``"length"`` (max_tokens 0 reached; ``"abort"`` stays)."""
    reason = None
    if out.finished:
        reason = "abort" if out.finish_reason == "abort" else "length"
    return dataclasses.replace(out, token_ids=[], new_token_ids=[], text="", num_output_tokens=0,
                               logprobs=[] if out.logprobs is not None else None, finish_reason=reason,
                               stop_reason=None, context_limit=None)


def shift_offsets(lp: Any, by: int) -> Any:
    """``lp`` (CompletionLogProbs) with every text_offset moved ``by`` characters (in place; returned)."""
    lp.text_offset = [o + by for o in lp.text_offset]
    return lp


def join_logprobs(first: Any, second: Any) -> Any:
    """Two CompletionLogProbs one after the other (``second`` may be None)."""
    if second is None:
        return first
    return type(first)(tokens=first.tokens + second.tokens, token_logprobs=first.token_logprobs
                       + second.token_logprobs, top_logprobs=first.top_logprobs + second.top_logprobs,
                       text_offset=first.text_offset + second.text_offset)


def delta_logprobs(out: Any) -> list[dict]:
    """The log-prob entries of ``out.new_token_ids`` whether the engine reports them whole or per step."""
    lps = out.logprobs
    if not lps:
        return []
    new = len(out.new_token_ids or ())
    if len(lps) == len(out.token_ids):
        return list(lps[len(lps) - new:]) if new else []
    return list(lps[-new:]) if new else []




#: SentencePiece's word-boundary mark (U+2581 LOWER ONE EIGHTH BLOCK): the space before a piece
SENTENCEPIECE_SPACE = "\u2581"


class TokenText:
    """Token id -> display string for log-probs (cached ``tokenizer.decode([id])``), and -> the token's raw
    UTF-8 bytes (OpenAI's chat ``bytes``: joining a text's token bytes gives its UTF-8 even where a character
    is split over byte tokens, whose display string is U+FFFD).

    A SentencePiece piece that starts a word (``▁the``, U+2581 marking the space before it, as in Llama-2's
    and Mistral's tokenizers) keeps that space (``" the"``): decoded alone, those tokenizers' decoders strip
    a text's first space, so ``decode([id])`` would be ``"the"`` and the joined tokens would lose every word
    boundary the text has."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.bytes_cache: dict[int, bytes] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_decoder: dict[str, int] = {}
        if self.byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([int(token_id)])
            if not s.startswith(" ") and not self.byte_level and int(token_id) not in self.special:
                piece = self.tokenizer.convert_ids_to_tokens(int(token_id)) or ""
                if piece.startswith(SENTENCEPIECE_SPACE):
                    s = " " + s
            if len(self.cache) < 200_000:
                self.cache[token_id] = s
        return s

    def raw_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: a byte-level BPE piece mapped back through GPT-2's byte alphabet, a
        SentencePiece byte-fallback piece (``<0xC3>``) as its byte, else the UTF-8 of its display string
        (special tokens, whole characters)."""
        b = self.bytes_cache.get(token_id)
        if b is not None:
            return b
        b = self(token_id).encode("utf-8")
        if int(token_id) not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id)) or ""
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                with contextlib.suppress(ValueError):
                    b = bytes([int(piece[3:5], 16)])
            elif self.byte_level and piece and all(c in self.byte_decoder for c in piece):
                b = bytes(self.byte_decoder[c] for c in piece)
        if len(self.bytes_cache) < 200_000:
            self.bytes_cache[token_id] = b
        return b


#: per thread, the byte ranges the last ``atomtool_replace_spans`` decode replaced (one U+FFFD each)
_SPANS = threading.local()


def _replace_recording_span(err: UnicodeDecodeError) -> tuple[str, int]:
    """``errors="replace"`` that also notes the replaced byte range (thread-local, read by TextOffsets)."""
    _SPANS.spans.append((err.start, err.end))
    return "\ufffd", err.end


codecs.register_error("atomtool_replace_spans", _replace_recording_span)


class TextOffsets:
    """OpenAI's completions ``text_offset``: where in the request's text each generated token starts, by the
    engine's own incremental detokenizer over the same prompt (special tokens, skipped in the text unless
    ``skip_special_tokens`` is false, take no room).

    A token whose bytes do not end a character yet is held back by the detokenizer, with any tokens after it,
    until the text grows; only then is it known where each of them starts, so their offsets are revised then:
    token i of such a group starts where the decoded text of the tokens before it (``P_i``) stops agreeing with
    the decoded text of the whole group (``R``), i.e. ``len(commonprefix(P_i, R))``. A token inside a valid
    multi-byte character therefore starts at that character (``P_i`` ends in U+FFFD where ``R`` has the
    character), and bytes that never form one (each a U+FFFD in the final text) start at their own U+FFFD.
    :attr:`offsets` holds every offset so far, revised in place."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), skip_special_tokens=skip_special_tokens)
        self.offsets: list[int] = []
        self._group: list[int] = []  # indices (into offsets) of the tokens held back since the text last grew
        self._context: list[int] = []  # a few ids before the group: left context for decoding it
        self._skipped: list[tuple[int, int]] = []  # skipped (special) tokens inside the group: (index, tokens before)
        self._bytes = None  # TokenText(tokenizer).raw_bytes, made at the first held-back group

    def next(self, token_ids: list[int]) -> list[int]:
        """Offsets of ``token_ids`` (the request's next generated tokens, in order), as known after them; an
        offset of a token still held back may be revised by a later call (read :attr:`offsets` then)."""
        first = len(self.offsets)
        for t in token_ids:
            t = int(t)
            before = len(self.detok.text(final=True))
            self.offsets.append(before)
            if t in self.detok.skipped:  # no text: it starts where the next token with text does
                if self._group:
                    self._skipped.append((len(self.offsets) - 1, len(self._group)))
                continue
            if not self._group:
                self._context = self.detok.ids[-8:]
            self._group.append(len(self.offsets) - 1)
            self.detok.add([t], check_stop=False)
            if len(self.detok.text(final=True)) > before:
                if len(self._group) > 1:
                    self._revise()
                self._group, self._skipped = [], []
        return self.offsets[first:]

    def _revise(self) -> None:
        ids = self.detok.ids[len(self.detok.ids) - len(self._group):]
        decode_ids = decoder_for(self.detok.tokenizer)

        def decode(part: list[int]) -> str:  # as the detokenizer decodes (its special-token skipping)
            return decode_ids(part, self.detok.skip)

        whole = decode(self._context + ids)
        skip = len(decode(self._context))
        base = self.offsets[self._group[0]]
        end = len(self.detok.text(final=True))
        starts = self._by_bytes(ids, whole[skip:])
        for i, k in enumerate(self._group[1:], start=1):
            if starts is not None:
                at = starts[i]
            else:  # where the text of the tokens before it stops agreeing with the group's text
                at = len(os.path.commonprefix([decode(self._context + ids[:i]), whole])) - skip
            self.offsets[k] = min(end, max(base, base + at, self.offsets[self._group[i - 1]]))
        for k, n_before in self._skipped:  # a skipped token after n_before of the group's tokens
            self.offsets[k] = self.offsets[self._group[n_before]] if n_before < len(self._group) else end

    def _by_bytes(self, ids: list[int], text: str) -> list[int] | None:
        """Per token of a held-back group, the index in ``text`` (the group's decoded text) of the character
        holding its first byte, from the tokens' own bytes decoded as the tokenizer does (invalid bytes: one
        U+FFFD per maximal ill-formed subsequence); None when the tokens' bytes are not known or do not decode
        to ``text`` (then :meth:`_revise` compares decoded prefixes instead). Exact where the prefix rule is
        not: a token continuing a truncated sequence (``e2 | 82 | o``) lies inside that sequence's U+FFFD."""
        if self._bytes is None:
            self._bytes = TokenText(self.detok.tokenizer).raw_bytes
        raw = [self._bytes(t) for t in ids]
        _SPANS.spans = []
        if b"".join(raw).decode("utf-8", "atomtool_replace_spans") != text:
            return None
        char_at, q, bad = [], 0, dict(_SPANS.spans)  # char_at[byte] = index of the character holding that byte
        for n, ch in enumerate(text):
            width = bad[q] - q if q in bad else len(ch.encode("utf-8"))
            char_at += [n] * width
            q += width
        pos, starts = 0, []
        for b in raw:
            starts.append(char_at[pos] if pos < len(char_at) else len(text))
            pos += len(b)
        return starts


def kept_at_stop(offsets: list[int], text_len: int, already: int = 0) -> int:
    """How many of a completion's next log-prob entries (their ``text_offset`` s, in order) a stop-string cut
    keeps: those of the tokens that start inside the final text (``text_len`` characters), and at least one
    entry in all (``already`` entries were kept before these)."""
    return max(1, already + sum(o < text_len for o in offsets)) - already


class StreamedLogProbs:
    """One request's completions log-probs in a stream: each entry goes out with the text its token starts
    (its offset below the text streamed so far), so tokens whose text is held back (an incomplete UTF-8
    character, a possible stop-string prefix) wait for it; at the end a stop-string cut keeps what the
    non-streamed response keeps (:func:`kept_at_stop`), so the streamed entries join to the same list."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.offsets = TextOffsets(tokenizer, prompt_token_ids, skip_special_tokens)
        self.pending: list[tuple[dict, int]] = []  # (entry, its index in offsets.offsets) not streamed yet
        self.released = 0  # entries streamed so far
        self.text_len = 0  # characters streamed so far

    def next(self, out: Any, entries: list[dict], delta: str) -> tuple[list[dict], list[int]]:
        """The entries (and their offsets) to send with ``delta``, the text chunk of output ``out``."""
        first = len(self.offsets.offsets)
        self.offsets.next([e["token_id"] for e in entries])
        self.pending += zip(entries, range(first, first + len(entries)), strict=True)
        offsets = self.offsets.offsets  # read at release: a held-back token's offset is revised when it resolves
        self.text_len += len(delta)
        if not out.finished:
            n = 0
            while n < len(self.pending) and offsets[self.pending[n][1]] < self.text_len:
                n += 1
        elif isinstance(out.stop_reason, str):  # the whole text has been streamed: text_len is its length
            n = kept_at_stop([offsets[i] for _, i in self.pending], self.text_len, self.released)
        else:
            n = len(self.pending)
        send, self.pending = self.pending[:n], self.pending[n:]
        self.released += len(send)
        return [e for e, _ in send], [offsets[i] for _, i in send]


