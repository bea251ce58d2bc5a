"""How much a request's fields may hold: stop strings, messages, logit_bias entries (stage ①).

The body's size is bounded first (limits.py, 4 MiB by default), but 4 MiB holds
400,000 stop strings, 130,000 messages or 300,000 logit_bias entries, and each
costs work long after parsing: every stop string is searched for at every
token, every message rendered. So each has a limit, a 400 naming it and the
flag that raises it:

    field                              default   flag
    stop / stop_sequences: how many        32    --max-stop-strings
    their characters, all together       4096    --max-stop-string-chars
    messages                           10,000    --max-messages
    logit_bias entries                   1024    --max-logit-bias-entries

OpenAI accepts 4 stop strings; vLLM has no limit on any of these. The defaults
leave room for what clients send while keeping the work per token and per
request small. Content parts cannot nest: a part is {"type": "text", "text": a
string}, and anything else in its place is a 400 naming the field. JSON nested
deeper than Python's parser goes (about a thousand levels) is a 400 too.

The checks run before pydantic validates the field's items, so an oversized
list is refused without being walked. A server's limits are bound to its own
body types (`bind`), where the request models' validators find them.
"""

from dataclasses import dataclass

DEFAULT_MAX_STOP_STRINGS = 32
DEFAULT_MAX_STOP_STRING_CHARS = 4096
DEFAULT_MAX_MESSAGES = 10_000
DEFAULT_MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class FieldLimits:
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS  # all of a request's stop strings together
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_logit_bias_entries: int = DEFAULT_MAX_LOGIT_BIAS_ENTRIES

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_chars", "max_messages", "max_logit_bias_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def check_stop(self, value):
        """`value` as sent (a string, a list of them, or anything pydantic will refuse later)."""
        strings = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if len(strings) > self.max_stop_strings:
            raise ValueError(f"has {len(strings)} stop strings, more than the limit of {self.max_stop_strings} "
                             "(--max-stop-strings)")
        num_chars = sum(len(s) for s in strings if isinstance(s, str))
        if num_chars > self.max_stop_string_chars:
            raise ValueError(f"has {num_chars} characters of stop strings, more than the limit of "
                             f"{self.max_stop_string_chars} (--max-stop-string-chars)")
        return value

    def check_messages(self, value):
        if isinstance(value, list) and len(value) > self.max_messages:
            raise ValueError(f"has {len(value)} messages, more than the limit of {self.max_messages} (--max-messages)")
        return value

    def check_logit_bias(self, value):
        if isinstance(value, dict) and len(value) > self.max_logit_bias_entries:
            raise ValueError(f"has {len(value)} entries, more than the limit of {self.max_logit_bias_entries} "
                             "(--max-logit-bias-entries)")
        return value

    def bind(self, body_type: type) -> type:
        """`body_type` as this server checks it: a subclass (same name) whose validators use these limits."""
        if self == body_type.limits:
            return body_type
        return type(body_type.__name__, (body_type,), {"limits": self, "__module__": body_type.__module__,
                                                        "__doc__": body_type.__doc__})
