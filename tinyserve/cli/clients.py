"""`tinyserve chat` and `tinyserve complete`: talk to a running server from the terminal.

Both speak to the server through the official `openai` client, exactly as an
application would, so what they show is what any OpenAI-compatible caller gets:

    tinyserve chat                      a conversation: each line you type is a user turn,
                                        the reply streams back, the history is kept
    tinyserve chat --quick "hi"         one turn, print the reply, exit
    tinyserve complete                  each line is a prompt for /v1/completions, no history

--url says where the server is (default: $TINYSERVE_URL, else http://localhost:8000/v1, where
`make serve` and `tinyserve serve` listen unless given a PORT or --port).
Without --model (vLLM's --model-name) they use the first model the server lists, as vLLM's CLI does.
Failures (no server at the URL, a 4xx answer, an error in the stream) end the
command with one line on stderr and exit code 1, never a traceback.
"""
# `openai` is imported when a command runs, not with this module: `tinyserve serve` builds its
# parser from here too. The module docstring is the commands' --help text: it speaks to users.

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

DEFAULT_URL = "http://localhost:8000/v1"
URL_ENV = "TINYSERVE_URL"  # where the server is, when it is not DEFAULT_URL (`make chat` sets it from PORT)
PROMPT = "> "


def add_parsers(commands) -> None:
    chat_parser = commands.add_parser("chat", help="chat with a running server", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_client_flags(chat_parser)
    chat_parser.add_argument("--system", default=None, help="a system message put before the conversation")
    chat_parser.add_argument("--quick", metavar="MESSAGE", default=None,
                             help="send this one message, print the reply and exit")
    chat_parser.set_defaults(handler=chat)

    complete_parser = commands.add_parser("complete", help="complete prompts with a running server", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_client_flags(complete_parser)
    complete_parser.add_argument("--quick", metavar="PROMPT", default=None,
                                 help="complete this one prompt, print the completion and exit")
    complete_parser.set_defaults(handler=complete)


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get(URL_ENV) or DEFAULT_URL,
                        help=f"the server's OpenAI base URL, e.g. http://127.0.0.1:8080/v1 for a server on port 8080 "
                             f"(default: ${URL_ENV}, else {DEFAULT_URL})")
    parser.add_argument("--model", "--model-name", default=None,
                        help="model name (default: the first one the server lists)")
    parser.add_argument("--api-key", default=None,
                        help="the server's --api-key (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--max-tokens", type=_positive_int, default=None,
                        help="most tokens per reply (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0 for greedy (default: the server's: the model's "
                             "generation_config.json, else 1.0)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ---- the two commands ------------------------------------------------------


def chat(args: argparse.Namespace) -> int:
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]

    def say(client: openai.OpenAI, model: str, line: str) -> None:
        messages.append({"role": "user", "content": line})
        stream = client.chat.completions.create(model=model, messages=messages, stream=True, **_sampling(args))
        reply = _print_stream(chunk.choices[0].delta.content for chunk in stream if chunk.choices)
        messages.append({"role": "assistant", "content": reply})

    return _run(args, say)


def complete(args: argparse.Namespace) -> int:
    def say(client: openai.OpenAI, model: str, line: str) -> None:
        stream = client.completions.create(model=model, prompt=line, stream=True, **_sampling(args))
        _print_stream(chunk.choices[0].text for chunk in stream if chunk.choices)

    return _run(args, say)


def _sampling(args: argparse.Namespace) -> dict:
    """The flags that were given; the others are left to the server's defaults."""
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {name: value for name, value in given.items() if value is not None}


# ---- shared: connect, read lines, stream, report errors ---------------------


def _run(args: argparse.Namespace, say) -> int:
    """Connect, then call say(client, model, line) for --quick or for each line typed."""
    import openai

    # No retries: a person at a terminal wants to hear at once that the server is not there.
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=args.url, api_key=api_key, max_retries=0)
    try:
        model = args.model or _first_model(client)
        if model is None:
            print(f"error: the server at {args.url} lists no models; pass --model", file=sys.stderr)
            return 1
        if args.quick is not None:
            say(client, model, args.quick)
            return 0
        if sys.stdin.isatty():
            import readline  # noqa: F401  (imported for its side effect: line editing and history in input())
        for line in _typed_lines():
            say(client, model, line)
        return 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 0
    except openai.APIConnectionError as error:
        detail = str(error.__cause__ or "") or error.message  # the socket's reason, e.g. "Connection refused"
        print(f"error: cannot reach the server at {args.url} ({detail}); a server on another port: "
              f"--url http://127.0.0.1:PORT/v1, or ${URL_ENV}", file=sys.stderr)
    except openai.APIStatusError as error:
        print(f"error: the server at {args.url} answered {error.status_code}: {_error_message(error)}", file=sys.stderr)
    except openai.APIError as error:
        print(f"error: {error.message}", file=sys.stderr)
    return 1


def _first_model(client: openai.OpenAI) -> str | None:
    models = client.models.list().data
    return models[0].id if models else None


def _typed_lines() -> Iterable[str]:
    """Non-empty lines read after a `> ` prompt, until end of input (Ctrl-D)."""
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            return
        if line.strip():
            yield line


def _print_stream(pieces: Iterable[str | None]) -> str:
    """Print the text pieces as they arrive; return them joined."""
    text = []
    for piece in pieces:
        if piece:
            print(piece, end="", flush=True)
            text.append(piece)
    print(flush=True)
    return "".join(text)


def _error_message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict):
        # OpenAI's client hands over the inner {"message": ...} of {"error": {...}}.
        inner = body.get("error", body)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
    return error.message

