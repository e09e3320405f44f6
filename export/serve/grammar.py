"""Structured output: a request's JSON schema, regular expression, choices or grammar as one llguidance grammar, and
the matcher that says which tokens a row may take next.

    from export.serve.grammar import Grammars, grammar_of
    spec = grammar_of("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}})  # ValueError: why
    matcher = Grammars(tokenizer, vocab=50304).matcher(spec)      # on the rank that samples the request
    matcher.fill(bitmask_row)      # int32 [ceil(vocab / 32)]: bit t % 32 of word t // 32 set where t may come next
    matcher.consume(token)

llguidance (Microsoft's grammar engine, on PyPI; one of the two vLLM and SGLang run) compiles JSON schemas, regular
expressions and Lark grammars, and computes a token mask in tens of microseconds. The front end compiles and
validates each request's grammar (`grammar_of`, a 400 naming the field when it is refused), the step carries the
grammar's text to the rank that holds the sequence, and that rank's sampler masks the row's logits with it inside
the batched sampler (export/serve/sampling.py), so rows with and without a grammar share a step. When the grammar
is complete only the end token is allowed.
"""

from __future__ import annotations

import json
import threading

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it (", " and ": ", no other whitespace): a model that pads with whitespace cannot run on
# without end, and the text parses the same
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_string(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes, which Lark's strings take)."""
    return json.dumps(text)


def grammar_of(kind: str, value) -> str:
    """llguidance's grammar text for a request's constraint, validated: `kind` one of KINDS; `value` a JSON schema
    (dict or its JSON text), a regular expression, a list of choices, or a Lark grammar (json_object: ignored).
    ValueError with the reason when it cannot be compiled."""
    from llguidance import LLMatcher

    if kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    elif kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"the schema is not valid JSON ({err})") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError("the schema must be a JSON object")
        try:
            grammar = LLMatcher.grammar_from_json_schema(value, overrides=JSON_OPTIONS)
        except ValueError as err:
            raise ValueError(f"the schema cannot be compiled ({err})") from None
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("send a non-empty regular expression")
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("send a non-empty list of non-empty strings")
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in value))
    elif kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("send a Lark grammar (llguidance's dialect) as text")
        grammar = LLMatcher.grammar_from_lark(value)
    else:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ValueError(" ".join(messages[0].split()) if messages else "the grammar is not valid")
    return grammar


class Matcher:
    """One sequence's place in its grammar. `error`: why the grammar refused a token (the request then fails)."""

    def __init__(self, matcher):
        self.m = matcher
        self.error: str | None = matcher.get_error() if matcher.is_error() else None

    def fill(self, row) -> None:
        """Write the allowed next tokens into `row` (a contiguous int32 tensor, ceil(vocab / 32) words)."""
        if self.error is None:
            self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if self.m.is_error():
                self.error = self.m.get_error()

    def consume(self, token: int) -> None:
        if self.error is None and not self.m.consume_token(token):
            self.error = self.m.get_error() or f"the grammar refused token {token}"

    @property
    def done(self) -> bool:
        return self.m.is_stopped()


class Grammars:
    """Matchers for one tokenizer: its llguidance tokenizer is built once (about a second for 50k tokens), at the
    first request with a grammar; grammars compiled once each (a cache of recent ones)."""

    def __init__(self, tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self._ll = None
        self._lock = threading.Lock()

    def _lltokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab)
            return self._ll

    def matcher(self, grammar: str) -> Matcher:
        from llguidance import LLMatcher

        return Matcher(LLMatcher(self._lltokenizer(), grammar, log_level=0))
