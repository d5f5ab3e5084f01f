"""Who a peer is and who a message comes from: the run secret, per-peer Ed25519 keys, join proofs,
signed requests and a replay guard.

The design (why not one shared HMAC key): with a key every member can derive (e.g.
``HMAC(secret, machine id)``), every secret holder could compute every member's key and speak for
any of them. Here the run secret only *admits*; identity is a key pair:

* **run secret** ``S`` (:func:`new_secret`: 32 random bytes, hex): whoever holds it may join.
  It never travels: calls carry the *access token* ``HMAC-SHA256(S, "zeroth-access-v1")`` (128 bits)
  (:func:`access_token`, metadata ``x-zeroth-token``, checked before any handler runs), and a
  join carries ``proof = HMAC-SHA256(S, "zeroth-join-v1" || config_digest || address || key)``
  (:func:`join_proof`), binding the joiner's public key to its knowledge of ``S``.
* **identity** (:class:`Identity`): every peer process generates an Ed25519 key pair; the commit
  that admits it writes its public key into the view. Every message it sends afterwards is signed
  with its private key: a message claiming machine ``m`` verifies only under ``m``'s key, so a
  member (or anyone holding ``S``) can never speak for another member.
* **calls that open a stream** (a pipeline stage's link to the next one): the caller signs the
  call's purpose (:func:`call_metadata`: its public key, a sequence number and the signature in the
  call's metadata) and the server checks it against the key it expects (:func:`call_signer`)
  before it reads anything of the stream.
* **requests that are not protocol messages** (log, checksum, state): signed over
  :func:`request_bytes` (method, run id, sender, fields, a per-sender sequence number);
  :class:`ReplayGuard` refuses a sequence number it has seen. Protocol messages are bound to
  (run id, iteration, ballot) by their content, and replaying one is idempotent.

Ed25519 signatures are deterministic, so the protocol's own signing stays a pure function.

Example:
  >>> me = Identity.generate()
  >>> sig = me.sign(b"hello")
  >>> verify(me.public, b"hello", sig), verify(me.public, b"hellO", sig)
  (True, False)
  >>> len(access_token("s3cret")), join_proof("s3cret", "d", "h:1", me.public) == join_proof("other", "d", "h:1", me.public)
  (22, False)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat


__all__ = [
    "SECRET_ENV",
    "Identity",
    "new_secret",
    "access_token",
    "secret_from_env",
    "token_from_env",
    "launch_env",
    "join_proof",
    "check_join_proof",
    "log_proof",
    "check_log_proof",
    "verify",
    "request_bytes",
    "ReplayGuard",
    "Sequence",
    "write_secret",
    "read_secret",
    "canonical",
    "CALL_KEY",
    "CALL_SEQ",
    "CALL_SIG",
    "call_metadata",
    "call_signer",
]

SECRET_ENV = ("ZEROTH_SECRET", "ZEROTH_TOKEN")  # environment variables holding the run secret, first wins


class Identity:
    """An Ed25519 key pair: ``public`` (32 bytes) goes into the view, :meth:`sign` signs messages."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data`` (deterministic)."""
        return self._private.sign(data)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the private key (hex) to ``path``, readable by its owner only (mode 0600), for a
        process started by another to sign with (:meth:`load`)."""
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        raw = self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return write_secret(path, raw.hex())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        """The identity whose private key :meth:`save` wrote to ``path``.

        Raises:
          ValueError: the file does not hold a private key of 64 hex digits (naming the file).
        """
        text = read_secret(path)
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ValueError(f"identity file {str(path)!r} does not hold an Ed25519 private key (64 hex digits)")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature of ``data``."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(data))
    except (InvalidSignature, ValueError):
        return False
    return True


def new_secret() -> str:
    """A fresh run secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def launch_env(insecure: bool, environ=None) -> dict[str, str]:
    """The environment a launcher gives the processes of one run: ``environ`` (default
    ``os.environ``) with a fresh run secret in ``SECRET_ENV[0]``, or unchanged with ``insecure``."""
    env = dict(os.environ if environ is None else environ)
    if not insecure:
        env[SECRET_ENV[0]] = new_secret()
    return env


def secret_from_env(environ=None) -> str | None:
    """The run secret set in the environment (the first of :data:`SECRET_ENV` that is set), or None."""
    environ = os.environ if environ is None else environ
    return next((environ[k] for k in SECRET_ENV if environ.get(k)), None)


def token_from_env(insecure: bool, environ=None) -> str | None:
    """The access token of the run secret in the environment (:data:`SECRET_ENV`), or None with ``insecure``.

    Raises:
      ValueError: no secret is set and ``insecure`` is false (the message says what to set).
    """
    if insecure:
        return None
    secret = secret_from_env(environ)
    if secret is None:
        raise ValueError(
            f"no run secret: set {SECRET_ENV[0]} (the same on every process of the run) "
            "or pass --insecure (loopback experiments only)"
        )
    return access_token(secret)


def _mac(secret: str, *fields) -> bytes:
    return hmac.new(secret.encode(), canonical(*fields), hashlib.sha256).digest()


def access_token(secret: str) -> str:
    """The token every call carries (``x-zeroth-token``): the first 128 bits of
    ``HMAC-SHA256(secret, "zeroth-access-v1")``, base64url without padding (22 characters: it is
    sent with every request)."""
    return base64.urlsafe_b64encode(_mac(secret, "zeroth-access-v1")[:16]).rstrip(b"=").decode()


def join_proof(secret: str, config_digest: str, address: str, key: bytes) -> bytes:
    """A joiner's proof that it holds the run secret, bound to its config digest, address and public key."""
    return _mac(secret, "zeroth-join-v1", config_digest, address, bytes(key))


def check_join_proof(secret: str, proof: bytes, config_digest: str, address: str, key: bytes) -> bool:
    """Constant-time check of :func:`join_proof`."""
    return hmac.compare_digest(bytes(proof), join_proof(secret, config_digest, address, key))


def log_proof(secret: str, run_id: str, key: bytes) -> bytes:
    """A peer's proof, written into its update log, that the process signing with ``key`` held the
    run secret: what lets ``zeroth verify --secret-file`` tell a run's own log from one made
    with keys of somebody else's (:mod:`zeroth.net.verify`)."""
    return _mac(secret, "zeroth-log-v1", run_id, bytes(key))


def check_log_proof(secret: str, proof: bytes, run_id: str, key: bytes) -> bool:
    """Constant-time check of :func:`log_proof`."""
    return hmac.compare_digest(bytes(proof), log_proof(secret, run_id, key))


def request_bytes(method: str, run_id: str, sender: int, seq: int, *fields) -> bytes:
    """What a sender signs for a request that is not a protocol message (``FetchLog``, ``Checksum``, ...)."""
    return canonical("zeroth-request-v1", method, run_id, sender, seq, *fields)


class ReplayGuard:
    """Refuses a (sender, sequence number) seen before, with a bounded memory per sender.

    Sequence numbers grow per sender (a sender starts from its clock in nanoseconds, so a restarted
    process never reuses old numbers) but may arrive out of order: the guard keeps the last
    ``window`` numbers of each sender and refuses anything at or below the oldest one it forgot.
    """

    def __init__(self, window: int = 4096):
        self.window = window
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], set[int]] = {}
        self._floor: dict[tuple[str, int], int] = {}

    def accept(self, run_id: str, sender: int, seq: int) -> bool:
        """Record ``seq`` for ``sender``; False if it is a replay (or too old to tell)."""
        k = (run_id, sender)
        with self._lock:
            seen = self._seen.setdefault(k, set())
            if seq <= self._floor.get(k, -1) or seq in seen:
                return False
            seen.add(seq)
            if len(seen) > self.window:
                drop = sorted(seen)[: len(seen) - self.window // 2]
                self._floor[k] = drop[-1]
                seen.difference_update(drop)
            return True


class Sequence:
    """Per-process increasing sequence numbers for signed requests (start: the clock in ns)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = time.time_ns()

    def next(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


CALL_KEY, CALL_SEQ, CALL_SIG = "x-zeroth-key", "x-zeroth-seq", "x-zeroth-sig"  # metadata of a signed call


def call_metadata(me: Identity, seq: int, *fields) -> tuple[tuple[str, str], ...]:
    """Call metadata proving that ``me`` opened the call for ``fields`` (its purpose: e.g. the
    run, the link): ``me``'s public key, ``seq`` and the signature of
    ``canonical("zeroth-call-v1", seq, key, *fields)``, hex."""
    sig = me.sign(canonical("zeroth-call-v1", int(seq), me.public, *fields))
    return ((CALL_KEY, me.public.hex()), (CALL_SEQ, str(int(seq))), (CALL_SIG, sig.hex()))


def call_signer(metadata, *fields) -> tuple[bytes, int] | None:
    """``(public key, seq)`` of the caller that signed a call for ``fields`` (:func:`call_metadata`),
    or None when the metadata carries no valid signature for them. Whether the key is the one
    expected is the caller's to check."""
    md = {k: v for k, v in (metadata or ()) if k in (CALL_KEY, CALL_SEQ, CALL_SIG)}
    try:
        key, seq, sig = bytes.fromhex(md[CALL_KEY]), int(md[CALL_SEQ]), bytes.fromhex(md[CALL_SIG])
    except (KeyError, ValueError, TypeError):
        return None
    if seq < 0 or not verify(key, canonical("zeroth-call-v1", seq, key, *fields), sig):
        return None
    return key, seq


def write_secret(path: str | os.PathLike, secret: str) -> Path:
    """Write ``secret`` to ``path`` readable by its owner only (mode 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    os.chmod(path, 0o600)
    return path


def read_secret(path: str | os.PathLike) -> str:
    """The secret in ``path`` (stripped); refuses an empty file."""
    text = Path(path).read_text().strip()
    if not text:
        raise ValueError(f"secret file {str(path)!r} is empty")
    return text


def canonical(*fields) -> bytes:
    """An unambiguous byte encoding of nested ``int | bool | str | bytes | None | tuple`` values.

    Each value is a type tag, then: ints and strings as length-prefixed UTF-8 (ints in decimal),
    bytes length-prefixed, tuples as their length then their items. Two different field lists
    never encode to the same bytes.
    """
    out: list[bytes] = []

    def enc(v) -> None:
        if v is None:
            out.append(b"n")
        elif isinstance(v, bool):
            out.append(b"b1" if v else b"b0")
        elif isinstance(v, int):
            d = str(v).encode()
            out.append(b"i" + struct.pack("<I", len(d)) + d)
        elif isinstance(v, str):
            d = v.encode("utf-8", "surrogatepass")
            out.append(b"s" + struct.pack("<I", len(d)) + d)
        elif isinstance(v, bytes | bytearray):
            out.append(b"y" + struct.pack("<I", len(v)) + bytes(v))
        elif isinstance(v, tuple | list):
            out.append(b"t" + struct.pack("<I", len(v)))
            for x in v:
                enc(x)
        else:
            raise TypeError(f"canonical() cannot encode {type(v).__name__}")

    enc(tuple(fields))
    return b"".join(out)
