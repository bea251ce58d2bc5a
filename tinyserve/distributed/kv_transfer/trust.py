"""KV transfer as a trusted channel: one secret shared by every prefill and decode engine of a deployment.

    TINYSERVE_KV_TRANSFER_SECRET (in the environment of every server; a variable, so that it stays out
    of `ps`) is what makes two engines peers. From it:

    the kv_transfer_params    a producer signs the ones it hands out (remote_signature: an HMAC-SHA256 of
                              where the blocks are and for which prompt); a consumer refuses parameters
                              it cannot verify before it connects anywhere, so a client cannot make it
                              pull from a host and port of its choosing (a fake producer's K/V, a port
                              probe, a silent host holding the pull threads)
    the side channel          ZeroMQ CURVE (CurveZMQ, in the libzmq that pyzmq bundles): the producer's
                              socket is a CURVE server, each consumer's a CURVE client, both with the one
                              key pair derived from the secret, and a ZAP handler (pyzmq's
                              ThreadAuthenticator) admits only clients holding that pair. The library does
                              the handshake, proves each side holds the secret key before any message is
                              delivered, and encrypts every frame after it: a peer without the secret is
                              disconnected during the handshake, so nothing it sends reaches the side
                              channel's thread or its memory.

Without the secret a KV connector still starts (a recorded run replays without it), but refuses
kv_transfer_params, naming the variable: it neither hands out K/V nor pulls any.
"""

import hashlib
import hmac
import json
import logging
import os

import zmq
import zmq.auth.thread
from zmq.utils import z85

SECRET_ENV = "TINYSERVE_KV_TRANSFER_SECRET"
MAX_SECRET_CHARS = 1024
SIGNED_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
                 "remote_num_tokens", "remote_prompt_hash")


def shared_secret(environ=os.environ) -> str | None:
    """$TINYSERVE_KV_TRANSFER_SECRET, or None; a ValueError names the variable if it is too long."""
    secret = environ.get(SECRET_ENV) or None
    if secret is not None and len(secret) > MAX_SECRET_CHARS:
        raise ValueError(f"{SECRET_ENV} may be {MAX_SECRET_CHARS} characters at most")
    return secret


def _key(secret: str, purpose: str) -> bytes:
    """A 32-byte key of its own for each use of the secret."""
    return hashlib.sha256(f"tinyserve kv transfer {purpose}\0{secret}".encode()).digest()


def sign_params(secret: str, params: dict) -> str:
    """remote_signature: an HMAC-SHA256 (hex) of the signed fields, in a fixed order."""
    signed = json.dumps([params.get(name) for name in SIGNED_FIELDS], separators=(",", ":"))
    return hmac.new(_key(secret, "params"), signed.encode(), hashlib.sha256).hexdigest()


def signature_matches(secret: str, params: dict) -> bool:
    given = params.get("remote_signature")
    return isinstance(given, str) and hmac.compare_digest(given, sign_params(secret, params))


class SideChannelKeys:
    """The CURVE key pair every peer of the side channel holds, derived from the secret (z85-encoded).
    A connector without the secret gets a random pair of its own: nobody can complete its handshake."""

    def __init__(self, secret: str | None) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support, which the KV side channel's authentication "
                               "needs (pyzmq's own wheels bundle one that has it)")
        self.secret_key = z85.encode(_key(secret, "curve")) if secret else zmq.curve_keypair()[1]
        self.public_key = zmq.curve_public(self.secret_key)

    def start_authenticator(self, context: zmq.Context) -> zmq.auth.thread.ThreadAuthenticator:
        """ZAP for the context's CURVE servers: a client is admitted if its public key is the peers' one."""
        authenticator = zmq.auth.thread.ThreadAuthenticator(context, log=logging.getLogger(__name__))
        authenticator.start()
        authenticator.configure_curve_callback("*", credentials_provider=self)
        return authenticator

    def callback(self, domain: str, client_public_key: bytes) -> bool:
        return hmac.compare_digest(client_public_key, self.public_key)

    def serve(self, socket: zmq.Socket) -> None:
        socket.curve_server = True
        socket.curve_secretkey, socket.curve_publickey = self.secret_key, self.public_key

    def connect_as_client(self, socket: zmq.Socket) -> None:
        socket.curve_serverkey = self.public_key
        socket.curve_secretkey, socket.curve_publickey = self.secret_key, self.public_key

