"""Certificates made by the tests (with `cryptography`): a CA, a node certificate, a proxy client
certificate, and a rogue CA's client certificate that nodes must refuse."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pki:
    ca: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate signed by another CA
    rogue_key: Path

    def read(self, *paths: Path) -> list[bytes]:
        return [p.read_bytes() for p in paths]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False,
           names: list[str] = (), usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        sans = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def make_pki(directory: Path, node_names: list[str]) -> Pki:
    """A CA, one node certificate valid for `node_names` (IPs or DNS names), a client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, rogue_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _issue("pdserve test CA", ca_key, _name("pdserve test CA"), ca_key, ca=True)
    ca_path, _ = _write(directory, "ca", ca, ca_key)
    node_key, client_key, rogue_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    node = _issue("pdserve node", node_key, ca.subject, ca_key, names=node_names,
                  usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client = _issue("pd-proxy", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _issue("pd-proxy", rogue_key, _name("someone else's CA"), rogue_ca_key,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    node_paths, client_paths, rogue_paths = (_write(directory, stem, cert, key) for stem, cert, key in
                                             (("node", node, node_key), ("client", client, client_key),
                                              ("rogue", rogue, rogue_key)))
    return Pki(ca_path, *node_paths, *client_paths, *rogue_paths)
