"""Lark grammars: told apart from EBNF, and written as the EBNF xgrammar reads, as vLLM does.

vLLM documents `structured_outputs.grammar` as Lark or EBNF, and clients send either.
llguidance reads Lark itself, and so does xgrammar from 0.2 (`Grammar.from_lark`); an
older xgrammar reads only GBNF-style EBNF (`root ::= ...`), where a Lark grammar fails
with "EBNF lexer error". For it a grammar that looks like Lark (rules written `name: ...`,
no `::=` anywhere) is rewritten first, rule by rule (vLLM's convert_lark_to_ebnf):

    // and # comments                 dropped (outside quoted literals and regexes)
    name: a | b   with  | c  lines    name ::= a | b | c   (continuation lines joined)
    ?name, !name, name.2              the rule's name alone (inlining, keep-tokens and
                                      priorities do not change the language)
    'a'                               "a"
    "a".."z"                          [a-z]
    [a b]   (optional)                (a b)?
    x~3, x~2..5                       x{3}, x{2,5}
    /[0-9]+|x/  (a regex terminal)    a rule of its own: xgrammar's `Grammar.from_regex`
                                      writes the regex as EBNF rules, named lark_regex_N...
    root                              `root ::= start` (or the first rule) when none is named root

What EBNF has no form for is refused, naming it, with llguidance (or xgrammar 0.2) as the
way to use it: %import and %ignore directives, and flags (/.../i, "..."i).
"""

import re

from tinyserve.structured_output import GrammarError

_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)\s*(.*)$")
_ONE_CHAR = re.compile(r'"(\\.|[^"\\])"')
_RANGE_END = re.compile(r'\s*\.\.\s*"(\\.|[^"\\])"')
_REPEAT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_REGEX_ROOT = re.compile(r"lark_regex_\d+ ::= ")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NEEDS_LARK = "; serve with --structured-outputs-backend llguidance (or xgrammar 0.2, which reads Lark) to use it"


def grammar_is_likely_lark(text: str) -> bool:
    """A grammar with no `::=` and at least one `name:` rule."""
    return "::=" not in text and any(_RULE.match(line) for line in _strip_comments(text).splitlines())


def convert_lark_to_ebnf(text: str) -> str:
    """The Lark grammar `text` as xgrammar's EBNF (the module's table says how); GrammarError if it cannot be."""
    rules: list[list[str]] = []  # [name, body]
    for line in _strip_comments(text).splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("%"):
            raise GrammarError(f"structured_outputs.grammar: the Lark directive {stripped.split()[0]!r} has no EBNF "
                               f"form for this xgrammar{_NEEDS_LARK}")
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
    regex_rules: list[str] = []  # the rules the regex terminals became, after the grammar's own
    lines = [f"{name} ::= {_body(body, regex_rules)}" for name, body in rules]
    if "root" not in names:
        lines.insert(0, f"root ::= {'start' if 'start' in names else names[0]}")
    return "\n".join(lines + regex_rules) + "\n"


def _body(body: str, regex_rules: list[str]) -> str:
    out, i = [], 0
    while i < len(body):
        char = body[i]
        if char in "\"'":  # a literal, copied whole (as "..."), or a range of two
            end = _literal_end(body, i, char)
            if end > len(body):
                raise GrammarError(f"structured_outputs.grammar: an unclosed literal in {body[:80]!r}")
            literal = body[i:end] if char == '"' else _double_quoted(body[i + 1:end - 1])
            _refuse_flags(body, end, "a case-insensitive literal")
            range_end = _RANGE_END.match(body, end) if _ONE_CHAR.fullmatch(literal) else None
            if range_end is not None:
                out.append(f"[{literal[1:-1]}-{range_end.group(1)}]")
                end = range_end.end()
            else:
                out.append(literal)
            i = end
        elif char == "/":  # a regex terminal: a rule of its own, written by xgrammar
            end = i + 1
            while end < len(body) and body[end] != "/":
                end += 2 if body[end] == "\\" else 1
            if end >= len(body):
                raise GrammarError(f"structured_outputs.grammar: an unclosed regex in {body[:80]!r}")
            _refuse_flags(body, end + 1, "a regex with flags")
            out.append(_regex_rule(body[i + 1:end].replace("\\/", "/"), regex_rules))
            i = end + 1
        elif char == "[":  # Lark's optional; EBNF's [...] is a character class
            out.append("(")
            i += 1
        elif char == "]":
            out.append(")?")
            i += 1
        elif char == "~":
            repeat = _REPEAT.match(body, i)
            if repeat is None:
                raise GrammarError(f"structured_outputs.grammar: cannot read the repetition in {body[:80]!r}")
            low, high = repeat.groups()
            out.append(f"{{{low}}}" if high is None else f"{{{low},{high}}}")
            i = repeat.end()
        else:
            out.append(char)
            i += 1
    return "".join(out).strip()


def _literal_end(text: str, start: int, quote: str) -> int:
    """Just past the literal that opens at `start` (past the end of `text` if it is not closed)."""
    i = start + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _double_quoted(inner: str) -> str:
    """A single-quoted literal's content as a double-quoted one (vLLM takes 'a' for "a")."""
    def one(match: re.Match) -> str:
        if match.group(1) is None:  # a bare "
            return '\\"'
        return "'" if match.group(1) == "'" else match.group(0)

    return '"' + re.sub(r'\\(.)|"', one, inner) + '"'


def _refuse_flags(body: str, at: int, what: str) -> None:
    if at < len(body) and body[at].isalpha():
        raise GrammarError(f"structured_outputs.grammar: {what} ({body[:80]!r}) has no EBNF form{_NEEDS_LARK}")


def _regex_rule(pattern: str, regex_rules: list[str]) -> str:
    """The name of a rule matching `pattern`: xgrammar writes the regex as EBNF rules, added to regex_rules
    with their names made unique (lark_regex_N for its root, lark_regex_N_x for the others)."""
    import xgrammar as xgr

    try:
        written = str(xgr.Grammar.from_regex(pattern))
    except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError or its own types
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
        raise GrammarError(f"structured_outputs.grammar: the regex /{pattern}/ cannot be read: {message}") from None
    prefix = f"lark_regex_{sum(bool(_REGEX_ROOT.match(line)) for line in regex_rules)}"
    lines = [line for line in written.splitlines() if line.strip()]
    names = {line.split(" ::= ", 1)[0].strip() for line in lines}
    rename = {name: prefix if name == "root" else f"{prefix}_{name}" for name in names}
    for line in lines:
        name, rule = line.split(" ::= ", 1)
        regex_rules.append(f"{rename[name.strip()]} ::= {_renamed(rule, rename)}")
    return rename["root"]


def _renamed(rule: str, rename: dict[str, str]) -> str:
    """An EBNF rule's body with the rules it names renamed (literals and character classes left as they are)."""
    out, i = [], 0
    while i < len(rule):
        char = rule[i]
        if char in "\"[":
            close = '"' if char == '"' else "]"
            end = i + 1
            while end < len(rule) and rule[end] != close:
                end += 2 if rule[end] == "\\" else 1
            out.append(rule[i:end + 1])
            i = end + 1
            continue
        identifier = _IDENTIFIER.match(rule, i)
        if identifier is not None:
            out.append(rename.get(identifier.group(0), identifier.group(0)))
            i = identifier.end()
        else:
            out.append(char)
            i += 1
    return "".join(out)


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
            elif char in "\"'/" and not line.startswith("//", i):
                quote = char
            elif line.startswith("//", i) or char == "#":
                line = line[:i]
                break
            i += 1
        kept.append(line)
    return "\n".join(kept)
