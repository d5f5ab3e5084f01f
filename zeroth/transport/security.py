"""Who may talk to a peer: the shared token (call metadata) and TLS (server and client credentials).

* Token: every request carries ``x-zeroth-token: <token>``; :class:`TokenInterceptor` refuses a
  call whose token is missing or wrong with ``UNAUTHENTICATED`` before any handler runs
  (constant-time comparison).
* TLS: :class:`TLSFiles` names a PEM certificate chain and key (served) and the CA bundle that
  signs the other peers' certificates (trusted). :func:`self_signed` makes a certificate for
  loopback runs (``openssl`` command line, or the ``cryptography`` package when installed).

Example:
  >>> interceptor = TokenInterceptor("s3cret")
  >>> token_metadata("s3cret")
  (('x-zeroth-token', 's3cret'),)
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import shutil
import subprocess
from pathlib import Path

import grpc

__all__ = [
    "TOKEN_KEY",
    "TLSFiles",
    "TokenInterceptor",
    "DENIED",
    "token_matches",
    "token_metadata",
    "server_credentials",
    "channel_credentials",
    "self_signed",
    "can_make_certificates",
    "add_port",
    "bind",
    "open_channel",
    "add_tls_arguments",
    "tls_from_args",
]

TOKEN_KEY = "x-zeroth-token"


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """PEM files: ``cert`` (this peer's chain), ``key`` (its private key), ``ca`` (trusted roots);
    ``mutual``: both ends present a certificate signed by ``ca`` (mutual TLS)."""

    cert: str
    key: str
    ca: str
    mutual: bool = False

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for name in ("cert", "key", "ca"):
            path = Path(getattr(self, name))
            if not path.is_file():
                raise FileNotFoundError(f"TLS {name} file {str(path)!r} does not exist")
            out.append(path.read_bytes())
        return tuple(out)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying ``token`` (None without a token)."""
    return ((TOKEN_KEY, token),) if token else None


DENIED = f"missing or wrong {TOKEN_KEY} metadata: this run needs its shared token"


def token_matches(metadata, token: bytes) -> bool:
    """Whether call ``metadata`` carries ``token`` (constant-time comparison)."""
    got = dict(metadata or ()).get(TOKEN_KEY, "")
    got = got.encode() if isinstance(got, str) else bytes(got)
    return hmac.compare_digest(got, token)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the shared ``token`` with ``UNAUTHENTICATED``, at once: the refusal
    is a stream-stream handler whatever the method, which gRPC runs without reading a request
    message (a unary handler would first wait for the body in a server thread).
    :func:`zeroth.transport.guard.make_server` installs this check with the servers' other bounds."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the shared token must be a non-empty string")
        self._token = token.encode()

        def deny(request_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

        self._deny = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if token_matches(handler_call_details.invocation_metadata, self._token):
            return continuation(handler_call_details)
        return self._deny


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server credentials from ``tls.cert`` and ``tls.key``; with ``tls.mutual``, a client must present
    a certificate signed by ``tls.ca`` (the handshake fails otherwise, before any call)."""
    cert, key, ca = tls.read()
    if tls.mutual:
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    """Client credentials trusting ``tls.ca``; with ``tls.mutual``, presenting ``tls.cert`` (and its key)."""
    cert, key, ca = tls.read()
    if tls.mutual:
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.ssl_channel_credentials(root_certificates=ca)


def add_port(server: grpc.Server, listen: str, tls: TLSFiles | None = None) -> int:
    """Bind ``server`` to ``listen`` (``HOST:PORT``), over TLS when ``tls`` is given; returns the port
    (0 when it cannot be bound)."""
    try:
        return server.add_secure_port(listen, server_credentials(tls)) if tls else server.add_insecure_port(listen)
    except RuntimeError:  # some grpc versions raise where an address cannot be bound
        return 0


def bind(server: grpc.Server, listen: str, tls: TLSFiles | None = None) -> int:
    """:func:`add_port`, or ``OSError`` naming ``listen`` when it cannot be bound; returns the port."""
    port = add_port(server, listen, tls)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return port


def open_channel(address: str, options, tls: TLSFiles | None = None) -> grpc.Channel:
    """A channel to ``address`` with ``options``, over TLS (trusting ``tls.ca``) when ``tls`` is given."""
    if tls:
        return grpc.secure_channel(address, channel_credentials(tls), options=list(options))
    return grpc.insecure_channel(address, options=list(options))


def add_tls_arguments(parser) -> None:
    """The TLS options of a command that serves or calls (``zeroth peer``, ``stage``, ``node``)."""
    parser.add_argument("--tls-cert", default=None, help="this process's certificate chain (PEM)")
    parser.add_argument("--tls-key", default=None, help="its private key (PEM)")
    parser.add_argument("--tls-ca", default=None, help="the CA that signed the other processes' certificates (PEM)")
    parser.add_argument(
        "--tls-mutual",
        action="store_true",
        help="mutual TLS: present --tls-cert when calling, and refuse callers without a certificate signed by --tls-ca",
    )


def tls_from_args(args) -> TLSFiles | None:
    """The :class:`TLSFiles` of :func:`add_tls_arguments`' options (read once, so a missing file is
    named before anything starts); None without them.

    Raises:
      ValueError: some of the three files given without the others, or ``--tls-mutual`` without them.
      FileNotFoundError: a file that does not exist.
    """
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(files) and not all(files):
        raise ValueError("TLS needs --tls-cert, --tls-key and --tls-ca together")
    if args.tls_mutual and not all(files):
        raise ValueError("--tls-mutual needs --tls-cert, --tls-key and --tls-ca")
    if not all(files):
        return None
    tls = TLSFiles(*files, mutual=args.tls_mutual)
    tls.read()
    return tls


def can_make_certificates() -> bool:
    """Whether :func:`self_signed` can work here (``openssl`` on PATH or ``cryptography`` importable)."""
    if shutil.which("openssl"):
        return True
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return False
    return True


def self_signed(directory: str | os.PathLike, *, hosts=("127.0.0.1", "localhost"), days: int = 30) -> TLSFiles:
    """Write a self-signed certificate for ``hosts`` (its own CA) into ``directory``.

    Raises:
      RuntimeError: neither the ``openssl`` command nor the ``cryptography`` package is available.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / "cert.pem", d / "key.pem"
    sans = ",".join(("IP:" if _is_ip(h) else "DNS:") + h for h in hosts)
    openssl = shutil.which("openssl")
    if openssl:
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-sha256",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                str(days),
                "-subj",
                "/CN=zeroth-peer",
                "-addext",
                f"subjectAltName={sans}",
            ],
            check=True,
            capture_output=True,
        )
    else:
        _self_signed_cryptography(cert, key, hosts, days)
    os.chmod(key, 0o600)
    return TLSFiles(str(cert), str(key), str(cert))


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _self_signed_cryptography(cert_path: Path, key_path: Path, hosts, days: int) -> None:
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise RuntimeError(
            "making a TLS certificate needs the `openssl` command or `pip install cryptography`"
        ) from None
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zeroth-peer")])
    alt = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
