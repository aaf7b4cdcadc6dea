"""Incremental detokenization with stop strings.

Each new token is decoded together with a few preceding tokens (the offset technique of HF TGI / vLLM), so
text only ever grows, a multi-byte UTF-8 character split over tokens is emitted only once complete (no
U+FFFD mid-stream), and text that might still become a stop string is held back. Hence the concatenation
of streamed deltas equals the final text.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

_CONTEXT = 5  # tokens of left context used to decode a new token (word-boundary spaces, byte merges)

_SKIPPED_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> frozenset of ids
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (ids, skip) -> text


def _backend_decode(tokenizer) -> Callable[[list[int], bool], str] | None:
    """The Rust ``tokenizers.Tokenizer.decode`` of a transformers fast tokenizer when calling it gives exactly
    what ``tokenizer.decode(ids, skip_special_tokens=skip)`` gives on a list of ints; None otherwise.

    Why: transformers' ``decode`` wraps the one Rust call in argument normalisation (``to_py_obj`` walks the
    list) and keyword handling that cost about 8x the decode itself on the short windows the detokenizer
    decodes, twice per generated token (docs/PERFORMANCE.md, "Host cost of detokenization"). The wrapper adds
    nothing for a list of ints unless the tokenizer class overrides ``decode`` / ``_decode`` or asks for
    ``clean_up_tokenization_spaces`` (then the wrapper is used, as before)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its own decode
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


def decoder_for(tokenizer) -> Callable[[list[int], bool], str]:
    """``(ids, skip_special_tokens) -> text``, equal to ``tokenizer.decode(ids, skip_special_tokens=...)`` for a
    list of int ids: the backend's own decode where that is the same (:func:`_backend_decode`), else the
    tokenizer's. Chosen once per tokenizer (weak-keyed cache; a tokenizer that cannot be weakly referenced is
    not cached)."""
    try:
        return _DECODERS[tokenizer]
    except (KeyError, TypeError):
        pass
    fn = _backend_decode(tokenizer) or (lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip))
    try:
        _DECODERS[tokenizer] = fn
    except TypeError:
        pass
    return fn


def skipped_special_ids(tokenizer) -> frozenset[int]:
    """The special token ids ``tokenizer.decode(..., skip_special_tokens=True)`` drops: its special ids and
    special added tokens (``added_tokens_decoder``) that decode to nothing on their own. Computed once per
    tokenizer (a weak-keyed cache; a tokenizer that cannot be weakly referenced is not cached)."""
    try:
        return _SKIPPED_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    ids = frozenset(i for i in candidates if tokenizer.decode([i], skip_special_tokens=True) == "")
    try:
        _SKIPPED_IDS[tokenizer] = ids
    except TypeError:
        pass
    return ids


class IncrementalDetokenizer:
    """Detokenizes one request's generated tokens as they arrive.

    ``add(token_ids)`` returns the stop string found (text truncated before it, or after it with
    ``include_stop_str``: vLLM's ``include_stop_str_in_output``) or None. ``text(final)`` is the stable text:
    everything decoded minus held-back stop-string prefixes unless ``final``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop_str: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.stop = [s for s in (stop or []) if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.skip = skip_special_tokens
        self._decode_ids = decoder_for(tokenizer)
        self.include_stop_str = include_stop_str
        # ids the decoded text skips: left out of the decode window, so a run of them (EOS after EOS under
        # ignore_eos) costs no decoding instead of re-decoding a window that grows with every one of them
        self.skipped = skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._text = ""
        self._hold = 0  # length of the longest tail of _text that is a prefix of a stop string (held back)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip)

    def _append(self, delta: str, check_stop: bool = True) -> str | None:
        if self.stopped or not delta:
            return None
        # Only stop strings that end in ``delta`` count (one completed before, e.g. inside min_tokens, does
        # not; vLLM's rule). Such a string starts in ``delta`` or in the held-back tail (its part before
        # ``delta`` is a tail of the text that is a prefix of a stop string, at most _hold long), so only that
        # window is searched, and the new held-back tail is at most _hold + len(delta) long: the per-token
        # cost does not grow with the text or with the stop strings' length.
        old, old_hold = len(self._text), self._hold
        self._text += delta
        self._hold = self._stop_prefix_tail(old_hold + len(delta))
        if not self.stop or not check_stop:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, max(old - old_hold, old - len(s) + 1, 0))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self._text = self._text[:best[0] + (len(best[1]) if self.include_stop_str else 0)]
        self.stopped = True
        return best[1]

    def add(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Feed newly generated ids; returns the stop string if one appeared (then the text ends before it, or
        with it when ``include_stop_str``).

        ``check_stop=False`` (before ``min_tokens``): text is appended without looking for stop strings.
        """
        hit = None
        for tid in token_ids:
            if tid in self.skipped:
                continue
            self.ids.append(tid)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                hit = self._append(full[len(prefix):], check_stop) or hit
        return hit

    def flush(self) -> str | None:
        """At the end of generation: emit whatever is still pending (even an incomplete character)."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.prefix_offset = self.read_offset = len(self.ids)
            if len(full) > len(prefix):
                return self._append(full[len(prefix):])
        return None

    def _stop_prefix_tail(self, longest: int) -> int:
        """Length of the longest tail of the text, at most ``longest`` (and shorter than the longest stop
        string), that is a prefix of a stop string; 0 if none."""
        for n in range(min(len(self._text), self.max_stop - 1, longest), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def text(self, final: bool = False) -> str:
        """The stable text so far (``final``: all of it)."""
        if final or self.stopped:
            return self._text
        return self._text[:len(self._text) - self._hold]

    def text_since(self, start: int, final: bool = False) -> str:
        """``text(final)[start:]`` without copying the first ``start`` characters: the stable text after
        what a caller already has (the stable text only ever grows, so a caller that adds the length of each
        returned piece to ``start`` gets every character once, in order). O(length of the piece)."""
        end = len(self._text) if final or self.stopped else len(self._text) - self._hold
        return self._text[start:end]
