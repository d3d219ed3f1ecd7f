"""The run's own certificate authority for the etcd backend: who holds a certificate it signed gets in, nobody else.

    pki = make_pki(folder, addresses=["10.0.0.1", "10.0.0.2", "10.0.0.3"])   # once per run, on the console's machine
    pki.member_files()   # {"ca.crt": ..., "member.crt": ..., "member.key": ...}: what each etcd member needs
    pki.client_files()   # {"ca.crt": ..., "client.crt": ..., "client.key": ...}: what each engine needs

One CA per run (ECDSA P-256, valid for `days`: ten years, as runs on etcd last weeks and the CA is the run's
own), its key never leaves the console's machine. One member
certificate (server and client use: etcd members dial each other with it) names every member address, loopback
and localhost; one client certificate for the engines and the console. Every file is written mode 0600. Made
with the `cryptography` package; nothing is fetched.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA, MEMBER, CLIENT = "ca", "member", "client"


@dataclass(frozen=True)
class Pki:
    folder: Path

    def path(self, name: str) -> Path:
        return self.folder / name

    def member_files(self) -> dict[str, bytes]:
        return {n: self.path(n).read_bytes() for n in ("ca.crt", "member.crt", "member.key")}

    def client_files(self) -> dict[str, bytes]:
        return {n: self.path(n).read_bytes() for n in ("ca.crt", "client.crt", "client.key")}


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(addresses: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for a in addresses:
        try:
            ip = x509.IPAddress(ipaddress.ip_address(a))
            if ip not in names:
                names.append(ip)
        except ValueError:
            if x509.DNSName(a) not in names:
                names.append(x509.DNSName(a))
    return x509.SubjectAlternativeName(names)


def _issue(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey, *,
           days: int, ca: bool = False, usages: Sequence[x509.ObjectIdentifier] = (),
           san: x509.SubjectAlternativeName | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))  # hosts' clocks differ a little
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return builder.sign(signer, hashes.SHA256())


def fits(pki: Pki, addresses: Sequence[str], *, margin_days: float = 1.0) -> bool:
    """Whether a kept PKI still serves these members: its certificates valid for margin_days more, and the member
    certificate naming every address (a member moved to another address needs a certificate that names it)."""
    try:
        now = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=margin_days)
        certs = [x509.load_pem_x509_certificate(pki.path(f"{n}.crt").read_bytes()) for n in (CA, MEMBER, CLIENT)]
        if any(c.not_valid_after_utc <= now for c in certs):
            return False
        named = certs[1].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    return all(n in named for n in _san(addresses))


def make_pki(folder: str | Path, addresses: Sequence[str], *, run: str = "zeroband", days: int = 3650) -> Pki:
    """A fresh CA and the member and client certificates of one run, in folder (created 0700)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{run} etcd CA")])
    ca_cert = _issue(f"{run} etcd CA", ca_key, ca_name, ca_key, days=days, ca=True)
    _write_private(out / "ca.key", _key_pem(ca_key))
    _write_private(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    for name, usages, san in ((MEMBER, both, _san(addresses)), (CLIENT, (ExtendedKeyUsageOID.CLIENT_AUTH,), None)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"{run} etcd {name}", key, ca_name, ca_key, days=days, usages=usages, san=san)
        _write_private(out / f"{name}.key", _key_pem(key))
        _write_private(out / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    return Pki(out)
