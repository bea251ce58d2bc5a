"""Lark grammars for the xgrammar backend: converted to the EBNF xgrammar reads, as vLLM does.

vLLM documents `structured_outputs.grammar` as Lark or EBNF, and clients send either.
llguidance reads Lark itself; xgrammar reads only GBNF-style EBNF (`root ::= ...`), and a
Lark grammar there fails with "EBNF lexer error". So a grammar that looks like Lark (rules
written `name: ...`, no `::=` anywhere) is rewritten first, rule by rule:

    // and # comments                 dropped (outside quoted literals)
    name: a | b   with  | c  lines    name ::= a | b | c   (continuation lines joined)
    ?name, !name, name.2              the rule's name alone (inlining, keep-tokens and
                                      priorities do not change the language)
    "a".."z"                          [a-z]
    /[0-9]+/  (a regex terminal)      [0-9]+   (xgrammar's EBNF has classes, groups and
                                      quantifiers; flags after the slash are refused)
    root                              `root ::= start` (or the first rule) when none is named root

A %import or %ignore directive has no EBNF form: the grammar is refused, naming it, with
llguidance (--structured-outputs-backend llguidance) as the way to use it.
"""

import re

from tinyserve.structured_output import GrammarError

_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)\s*(.*)$")
_RANGE = re.compile(r'"(\\.|[^"\\])"\.\."(\\.|[^"\\])"')


def grammar_is_likely_lark(text: str) -> bool:
    """A grammar with no `::=` and at least one `name:` rule."""
    return "::=" not in text and any(_RULE.match(line) for line in _strip_comments(text).splitlines())


def convert_lark_to_ebnf(text: str) -> str:
    rules: list[list[str]] = []  # [name, body]
    for line in _strip_comments(text).splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("%"):
            raise GrammarError(f"structured_outputs.grammar: the Lark directive {stripped.split()[0]!r} has no EBNF "
                               "form for xgrammar; serve with --structured-outputs-backend llguidance to use it")
        if stripped.startswith("|"):
            if not rules:
                raise GrammarError("structured_outputs.grammar: an alternative ('|') before any rule")
            rules[-1][1] += " " + stripped
            continue
        match = _RULE.match(line)
        if match is None:
            raise GrammarError(f"structured_outputs.grammar: cannot read the Lark line {stripped[:80]!r}")
        rules.append([match.group(1), match.group(2)])
    if not rules:
        raise GrammarError("structured_outputs.grammar: no rules")
    names = [name for name, _ in rules]
    lines = [f"{name} ::= {_body(body)}" for name, body in rules]
    if "root" not in names:
        lines.insert(0, f"root ::= {'start' if 'start' in names else names[0]}")
    return "\n".join(lines) + "\n"


def _body(body: str) -> str:
    body = _RANGE.sub(lambda m: f"[{m.group(1)}-{m.group(2)}]", body)
    out, i = [], 0
    while i < len(body):
        char = body[i]
        if char == '"':  # a literal, copied whole
            end = _literal_end(body, i)
            out.append(body[i:end])
            i = end
        elif char == "/":  # a regex terminal: its pattern as EBNF
            end = body.find("/", i + 1)
            while end > 0 and body[end - 1] == "\\":
                end = body.find("/", end + 1)
            if end < 0:
                raise GrammarError(f"structured_outputs.grammar: an unclosed regex in {body[:80]!r}")
            if end + 1 < len(body) and body[end + 1].isalpha():
                raise GrammarError("structured_outputs.grammar: regex flags (/.../i) have no EBNF form for xgrammar")
            out.append(f"({body[i + 1:end]})")
            i = end + 1
        else:
            out.append(char)
            i += 1
    return "".join(out).strip()


def _literal_end(text: str, start: int) -> int:
    i = start + 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _strip_comments(text: str) -> str:
    """Each line without its // or # comment (a // or # inside a quoted literal or a regex stays)."""
    kept = []
    for line in text.splitlines():
        i, quote = 0, None
        while i < len(line):
            char = line[i]
            if quote:
                if char == "\\":
                    i += 1
                elif char == quote:
                    quote = None
            elif char in "\"/" and not line.startswith("//", i):
                quote = char
            elif line.startswith("//", i) or char == "#":
                line = line[:i]
                break
            i += 1
        kept.append(line)
    return "\n".join(kept)
