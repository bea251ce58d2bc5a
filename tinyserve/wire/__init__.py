"""The wire: what crosses between the front end and an engine process, imported by both.

messages.py holds the typed msgspec Structs (requests, outputs, stats); ipc.py the
ZeroMQ socket layout, the message kinds and their decoder. Nothing here imports either
side.
"""
