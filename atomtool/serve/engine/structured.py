"""Structured outputs: grammar-constrained decoding with xgrammar.

A request's :class:`~atomtool.serve.sampling_params.StructuredOutputsParams` is compiled once per distinct
constraint (:class:`GrammarBackend`, cached up to :data:`GRAMMAR_CACHE_BYTES`) into an xgrammar
``CompiledGrammar``; each sequence gets its own ``GrammarMatcher`` (its position in the grammar). Every step the sampler asks the matchers of the rows that
have one for their next-token bitmask and masks the other tokens to ``-inf`` (:func:`apply_token_bitmask`),
and the engine advances each matcher with the sampled token. Follows vLLM's xgrammar backend and XGrammar
(Dong et al. 2024, arXiv:2411.15100). xgrammar is imported only when a request asks for a constraint, so the
engine runs without it otherwise.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from atomtool.errors import InvalidRequestError
from atomtool.serve.sampling_params import StructuredOutputsParams

#: most bytes of compiled grammars the compiler keeps (xgrammar's LRU cache; vLLM's ``VLLM_XGRAMMAR_CACHE_MB``
#: default): a server whose clients send a new schema per request would otherwise grow without bound
GRAMMAR_CACHE_BYTES = 512 << 20

#: string formats xgrammar's JSON schema converter enforces (others it ignores; vLLM's STRING_SUPPORTED_FORMATS)
SUPPORTED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                               "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
#: keywords whose value is one subschema / a list of them / a map of name -> subschema (where a walk goes next)
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keys beside ``allOf`` that constrain nothing (xgrammar serves an ``allOf`` schema alone, dropping siblings)
_ANNOTATIONS = frozenset({"allOf", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description",
                          "examples", "default"})


def unenforced_keyword(schema: Any) -> str | None:
    """Where ``schema`` uses a keyword xgrammar (0.2.9) compiles but does not enforce, as ``'KEYWORD' at PATH``,
    or None. Such a schema would be served with the keyword ignored, so the output could break it; vLLM refuses
    these on its xgrammar backend too (``has_xgrammar_unsupported_json_features``). Found unenforced:
    ``multipleOf``, ``uniqueItems``, ``dependentRequired``, ``not``, an ``allOf`` of several schemas or with
    constraints beside it, a ``format`` outside :data:`SUPPORTED_FORMATS`, and a ``pattern`` / ``format`` with
    ``minLength`` / ``maxLength``. Walks subschemas only (a property *named* ``not`` is no keyword); iterative.
    """
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in ("multipleOf", "dependentRequired", "not"):
            if key in node:
                return f"{key!r} at {path}"
        if node.get("uniqueItems") is True:
            return f"'uniqueItems' at {path}"
        all_of = node.get("allOf")
        if isinstance(all_of, list) and (len(all_of) > 1 or set(node) - _ANNOTATIONS):
            return f"'allOf' at {path} (only a single schema with nothing beside it is enforced)"
        types = node.get("type")
        fmt = node.get("format") if types == "string" or (isinstance(types, list) and "string" in types) else None
        if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:  # (format only constrains strings: an
            return f"'format' {fmt!r} at {path}"  # OpenAPI-style integer "int32" is an annotation)
        if ("pattern" in node or fmt is not None) and ("minLength" in node or "maxLength" in node):
            return f"'minLength' / 'maxLength' beside 'pattern' / 'format' at {path}"
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}/{key}"))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()]
    return None


#: how to install the library when it is missing
INSTALL_HINT = "pip install 'xgrammar>=0.2.9' (or: pip install 'atomtool[serve]')"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise InvalidRequestError(f"structured outputs need the xgrammar library, which is not installed ({exc}); "
                                  f"{INSTALL_HINT}", param="structured_outputs") from None
    return xgrammar


class GrammarBackend:
    """Compiles constraints for one tokenizer / vocabulary and makes per-sequence matchers.

    Args:
        tokenizer: the model's transformers tokenizer (xgrammar reads its vocabulary and decoder type).
        vocab_size: the model's logits width (may exceed the tokenizer's size: padded rows are never allowed).

    Raises:
        InvalidRequestError: (``param="structured_outputs"``) xgrammar is not installed.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        # xgrammar's vocabulary must cover every id the tokenizer has, and the logits' width
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=max(vocab_size, len(tokenizer)))
        # the compiler caches each compiled constraint (least recently used ones evicted past the limit)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self._no_control: torch.Tensor | None = None  # see _json_tokens

    def _json_tokens(self) -> torch.Tensor:
        """int32 bitmask row (``ceil(V / 32)`` words) of the tokens whose text holds no control character
        (a byte 0x00-0x1f; never part of a multi-byte UTF-8 character), built once.

        A JSON output (``json`` / ``json_object``, compiled without free whitespace) never holds one: JSON
        strings must escape them (RFC 8259) and the separators are fixed spaces. xgrammar 0.2.9's rule for a
        string with ``minLength`` / ``maxLength`` excludes only ``"``, ``\\``, CR and LF, so its mask alone
        would let a raw ``\x01`` into such a string and the output would not parse.
        """
        if self._no_control is None:
            ok = torch.tensor([not any(b < 0x20 for b in text) for text in self.info.decoded_vocab], dtype=torch.bool)
            words = (self.info.vocab_size + 31) // 32
            bits = torch.zeros(words * 32, dtype=torch.int64)
            bits[:len(ok)] = ok.long()
            packed = (bits.view(words, 32) << torch.arange(32)).sum(1)  # bit t % 32 of word t // 32
            self._no_control = (packed - ((packed >> 31) << 32)).to(torch.int32)  # as int32 (two's complement)
        return self._no_control

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The xgrammar ``CompiledGrammar`` of ``params`` (cached by the compiler, up to
        :data:`GRAMMAR_CACHE_BYTES`; may be called from any thread: xgrammar's compiler and its cache are
        thread-safe, so the server compiles in a worker thread and the engine thread then finds it cached).

        Raises:
            InvalidRequestError: (``param="structured_outputs"``) xgrammar refuses the schema, regex or grammar,
                or the schema uses a keyword it would not enforce (:func:`unenforced_keyword`).
        """
        kind, text = params.key()
        if kind == "json":
            where = unenforced_keyword(json.loads(text))
            if where is not None:
                raise InvalidRequestError(f"the json schema uses {where}, which the grammar compiler (xgrammar) "
                                          "cannot enforce: the output could break it; remove it or use a "
                                          "keyword it enforces (enum, pattern, minimum/maximum...)",
                                          param="structured_outputs")
        try:
            if kind == "json":  # any_whitespace off: a small model otherwise tends to emit whitespace forever
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":  # OpenAI's json_object: one JSON object (the builtin JSON grammar would
                # also allow arrays and scalars)
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "choice":
                # one EBNF alternative per choice; json.dumps writes each as a quoted, escaped string literal,
                # non-ASCII kept as is: xgrammar reads a \u escape as one code point, so a character outside
                # the BMP written as a surrogate pair of escapes would become two invalid ones
                compiled = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text)))
            else:
                compiled = self.compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types, message first
            # xgrammar's C++ messages start with "[HH:MM:SS] /path/file.cc:LINE: ": the client needs only the cause
            detail = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", " ".join(str(exc).split()))[:500]
            raise InvalidRequestError(f"cannot compile the {kind.replace('_', ' ')} constraint: {detail}",
                                      param="structured_outputs") from None
        return compiled

    def matcher(self, params: StructuredOutputsParams, stop_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher at the start of ``params``' grammar; ``stop_token_ids`` (the request's EOS ids)
        are the tokens that may end a complete output."""
        xgr = _xgrammar()
        compiled = self.compile(params)
        stops = [t for t in stop_token_ids if 0 <= t < self.vocab_size]
        allowed = None
        if params.key()[0] in ("json", "json_object"):
            allowed = self._json_tokens().clone()
            for t in stops:  # the stop tokens end a complete output, whatever their text
                allowed[t // 32] |= _bit(t % 32)
        return GrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None), self.info.vocab_size,
                              allowed)


def _bit(i: int) -> torch.Tensor:
    """Bit ``i`` (0-31) of an int32 bitmask word, as an int32 scalar tensor."""
    return torch.tensor(1 << i if i < 31 else -(1 << 31), dtype=torch.int32)


class GrammarMatcher:
    """One sequence's position in its grammar (a thin wrapper over xgrammar's ``GrammarMatcher``).

    Args:
        matcher: the xgrammar matcher. bitmask_vocab: its vocabulary size (bits per bitmask row).
        allowed: an int32 bitmask row the grammar's mask is and-ed with (None: the grammar's alone); see
            :meth:`GrammarBackend._json_tokens`.
    """

    def __init__(self, matcher: Any, bitmask_vocab: int, allowed: torch.Tensor | None = None) -> None:
        self._m = matcher
        self.bitmask_vocab = bitmask_vocab
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word ``t // 32``)."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the state is unchanged)."""
        return bool(self._m.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The output is complete and a stop token was accepted: nothing may follow."""
        return bool(self._m.is_terminated())


def fill_bitmasks(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] host bitmask of the rows' allowed next tokens (R = len(matchers) >= 1)."""
    vocab = matchers[0].bitmask_vocab
    bitmask = torch.zeros(len(matchers), (vocab + 31) // 32, dtype=torch.int32)
    for r, m in enumerate(matchers):
        m.fill_bitmask(bitmask, r)
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token outside ``bitmask`` set to ``-inf`` in ``rows``; a new tensor.

    xgrammar's ``apply_token_bitmask_inplace`` on a copy: its C++ kernel on the CPU (measured 0.3 ms for 64 rows
    of a 131k vocabulary, against ~40 ms for the same mask expanded with torch ops), its Triton kernel on a
    CUDA GPU (what vLLM runs).

    Args:
        logits: [B, V] float32 (not modified). rows: the R rows to mask (distinct). bitmask: int32 [R, W] on
            the host, ``32 * W >= V``, row j for ``rows[j]``; bit ``t % 32`` of word ``t // 32`` set = token t
            allowed.
    """
    xgr = _xgrammar()
    num_rows, vocab = logits.shape
    if len(rows) == num_rows and rows == list(range(num_rows)):
        full, indices = bitmask, None
    else:  # xgrammar indexes the bitmask by batch row: unconstrained rows get an all-ones (never read) row
        full = torch.full((num_rows, bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        indices = list(rows)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, full.to(logits.device, non_blocking=True), vocab_size=vocab,
                                    indices=indices)
    return out
