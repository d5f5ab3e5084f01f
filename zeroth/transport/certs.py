"""``zeroth certs``: a small certificate authority and one certificate per host, for mutual TLS.

  zeroth certs --out DIR HOST [HOST ...] [--days N]

writes ``DIR/ca.pem`` (the CA every host trusts), ``DIR/ca.key`` (mode 0600: keep it on the machine
that made the certificates) and, per host, ``DIR/HOST/cert.pem`` and ``DIR/HOST/key.pem`` (mode
0600): a certificate for the name or IP address ``HOST`` (its subject alternative name), good for
serving and for calling (mutual TLS). A CA already in ``DIR`` is reused, so hosts can be added
later. Copy ``ca.pem`` and a host's folder to that host; ``zeroth launch --tls-dir DIR`` finds its
own folder by the address it advertises (or its host name).

Example:
  >>> import tempfile, pathlib
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> files = make_host_certificates(d, ["10.0.0.1", "node-b"])
  >>> sorted(p.relative_to(d).as_posix() for p in d.rglob("*.pem"))
  ['10.0.0.1/cert.pem', '10.0.0.1/key.pem', 'ca.pem', 'node-b/cert.pem', 'node-b/key.pem']
  >>> files["node-b"].ca == str(d / "ca.pem"), files["node-b"].mutual
  (True, True)
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
from pathlib import Path

from zeroth.transport.security import TLSFiles

__all__ = [
    "make_host_certificates",
    "host_tls",
]

_HOST = re.compile(r"^[A-Za-z0-9.:_-]{1,253}$")  # a DNS name or an IP address: also a safe folder name


def _crypto():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_key(path: Path, key) -> None:
    _, _, serialization, _, _, _ = _crypto()
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)


def _ca(directory: Path, days: int):
    x509, hashes, serialization, ec, _, NameOID = _crypto()
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    if cert_path.is_file() and key_path.is_file():
        return (
            x509.load_pem_x509_certificate(cert_path.read_bytes()),
            serialization.load_pem_private_key(key_path.read_bytes(), password=None),
        )
    if cert_path.exists() or key_path.exists():
        raise ValueError(f"{directory} holds only one of ca.pem and ca.key: restore the other or choose another --out")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zeroth run CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def make_host_certificates(directory: str | os.PathLike, hosts, *, days: int = 365) -> dict[str, TLSFiles]:
    """Make (or reuse) the CA in ``directory`` and a certificate for each of ``hosts``; returns each
    host's :class:`~zeroth.transport.security.TLSFiles` (mutual).

    Raises:
      ValueError: a host that is neither a DNS name nor an IP address, no host, or ``days < 1``.
    """
    x509, hashes, serialization, ec, EKU, NameOID = _crypto()
    hosts = list(hosts)
    if not hosts:
        raise ValueError("name at least one host (its DNS name or IP address)")
    bad = [h for h in hosts if not _HOST.match(h) or h in (".", "..")]
    if bad:
        raise ValueError(f"host {bad[0]!r} is not a DNS name or an IP address (letters, digits, '.', ':', '-', '_')")
    if days < 1:
        raise ValueError(f"--days {days}: a certificate must be valid for at least one day")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca(d, days)
    now = datetime.datetime.now(datetime.UTC)
    out = {}
    for host in hosts:
        try:
            alt = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        hd = d / host
        hd.mkdir(exist_ok=True)
        _write_key(hd / "key.pem", key)
        (hd / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[host] = TLSFiles(str(hd / "cert.pem"), str(hd / "key.pem"), str(d / "ca.pem"), mutual=True)
    return out


def host_tls(directory: str | os.PathLike, names) -> TLSFiles:
    """The mutual TLS files of this host in a folder made by :func:`make_host_certificates`: the
    first of ``names`` (e.g. the advertised address, the host name) that has a folder there.

    Raises:
      FileNotFoundError: ``ca.pem`` is missing, or no name has its certificate there (all are named).
    """
    d = Path(directory)
    if not (d / "ca.pem").is_file():
        raise FileNotFoundError(
            f"{d / 'ca.pem'} does not exist: make the certificates with `zeroth certs --out {d} HOST ...`"
        )
    for name in names:
        if name and (d / name / "cert.pem").is_file() and (d / name / "key.pem").is_file():
            return TLSFiles(str(d / name / "cert.pem"), str(d / name / "key.pem"), str(d / "ca.pem"), mutual=True)
    raise FileNotFoundError(
        f"no certificate for this host in {d} (looked for {', '.join(repr(n) for n in names if n)}): "
        f"make one with `zeroth certs --out {d} {next((n for n in names if n), 'HOST')}` and copy it here"
    )


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth certs``; returns the exit code."""
    p = argparse.ArgumentParser(prog="zeroth certs", description="Make a CA and per-host certificates for mutual TLS.")
    p.add_argument("hosts", nargs="+", metavar="HOST", help="a host's DNS name or IP address (as the others reach it)")
    p.add_argument(
        "--out", required=True, help="folder for ca.pem, ca.key and HOST/{cert,key}.pem (a CA there is reused)"
    )
    p.add_argument("--days", type=int, default=365, help="days the certificates are valid (default 365)")
    args = p.parse_args(argv)
    try:
        made = make_host_certificates(args.out, args.hosts, days=args.days)
    except (ValueError, OSError) as e:
        print(f"zeroth certs: error: {e}", file=sys.stderr)
        return 2
    for host, tls in made.items():
        print(f"{host}: {tls.cert} {tls.key}")
    print(f"CA: {Path(args.out) / 'ca.pem'} (copy it and each host's folder to that host; keep ca.key here)")
    return 0
