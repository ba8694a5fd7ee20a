"""Making the control plane's certificates: a CA, and the coordinator's, the admin's and one per node.

The CA's private key goes to a folder of its own (``<DIR>-ca-key`` by default), never into the folder
machines get their certificates from. Roles and names are those :mod:`~octopipe.execute.control.security`
checks. ``octopipe certs make|node|copy|show`` call these.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from octopipe.execute.control.security import (
    ADMIN,
    COORDINATOR,
    NODE,
    ROLES,
    CertPaths,
    node_identity,
    node_server_name,
    subject_of,
)

__all__ = ["add_node_certs", "ca_key_folder", "copy_identity", "describe_certs", "make_certs"]

_CA = "ca"
_VALID_DAYS = 30


def copy_identity(folder: Path, identity: str, out: Path) -> list[Path]:
    """Copy what one machine needs into ``out``: the CA certificate and ``identity``'s certificate and key (never
    the CA's key, never another identity's key). Returns the files written."""
    source = CertPaths(folder, identity)
    source.read()  # a missing file is named with the command that makes it
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in (source.ca, source.cert, source.key):
        target = out / path.name
        target.write_bytes(path.read_bytes())
        if path == source.key:
            target.chmod(0o600)
        written.append(target)
    return written


def describe_certs(folder: Path) -> list[tuple[str, str | None, str | None, datetime.datetime]]:
    """(identity, role, name, expiry) of every certificate in ``folder`` but the CA's, by identity."""
    found = []
    for pem in sorted(folder.glob("*.pem")):
        if pem.stem == _CA:
            continue
        cert = x509.load_pem_x509_certificate(pem.read_bytes())
        role, name = subject_of(cert)
        found.append((pem.stem, role, name, cert.not_valid_after_utc))
    return found


def _name(common_name: str, role: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "octopipe"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def ca_key_folder(folder: Path) -> Path:
    """Where the CA's private key of certificate folder ``folder`` goes by default: a folder of its own beside
    it (``<folder>-ca-key``), so that copying ``folder`` (or a node's part of it) never copies the key."""
    return folder.parent / f"{folder.name}-ca-key"


def make_certs(
    folder: Path,
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    nodes: Sequence[str] = (),
    ca_name: str = "octopipe test CA",
    ca_key_dir: Path | None = None,
    force: bool = False,
) -> dict[str, CertPaths]:
    """Write a new CA and the certificates of a cluster into ``folder``; returns the paths by identity.

    ``coordinator`` (role coordinator), ``admin`` (role admin) and, for each
    of ``nodes``, ``node-<id>`` (role node, common name the node id). Every
    certificate is valid for ``hosts`` (IP addresses or DNS names) as a server
    and as a client. The CA's private key goes to ``ca_key_dir`` (default
    :func:`ca_key_folder`), never into ``folder``: it stays with the operator,
    for :func:`add_node_certs`. A folder that already holds a CA is refused
    unless ``force`` (a new CA invalidates every certificate the old one signed).
    """
    identities = [node_identity(node) for node in nodes]  # refuse a bad node id before writing anything
    key_dir = ca_key_dir or ca_key_folder(folder)
    if not force and ((folder / f"{_CA}.pem").exists() or (key_dir / f"{_CA}.key").exists()):
        raise FileExistsError(
            f"{folder} already has a CA: a new one would invalidate every certificate it signed. Add nodes with "
            f"`octopipe certs node {folder} ID`, or replace the CA with --force"
        )
    folder.mkdir(parents=True, exist_ok=True)
    key_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (folder / f"{_CA}.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_dir / f"{_CA}.key", ca_key)
    (folder / f"{_CA}.key").unlink(missing_ok=True)  # an older layout kept it here
    paths = {
        COORDINATOR: _issue(folder, ca_cert, ca_key, COORDINATOR, COORDINATOR, COORDINATOR, hosts),
        ADMIN: _issue(folder, ca_cert, ca_key, ADMIN, ADMIN, ADMIN, hosts),
    }
    for node, identity in zip(nodes, identities, strict=True):
        paths[identity] = _issue(folder, ca_cert, ca_key, identity, NODE, node, hosts)
    return paths


def add_node_certs(
    folder: Path,
    nodes: Sequence[str],
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    ca_key_dir: Path | None = None,
) -> dict[str, CertPaths]:
    """Write ``node-<id>`` certificates (role node, common name the id), signed by the CA of ``folder`` (its
    key in ``ca_key_dir``, default :func:`ca_key_folder`).

    An existing certificate of the same node is replaced. ``hosts`` are the
    addresses the node's daemon is reached at.
    """
    identities = [node_identity(node) for node in nodes]
    ca_pem, ca_key_path = folder / f"{_CA}.pem", (ca_key_dir or ca_key_folder(folder)) / f"{_CA}.key"
    if not ca_pem.is_file() or not ca_key_path.is_file():
        raise FileNotFoundError(
            f"no CA to sign with ({ca_pem} and {ca_key_path}): make one with `octopipe certs make {folder}`, or "
            "point --ca-key-dir at the folder holding its ca.key"
        )
    ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_key_path} is not the EC key `octopipe certs make` writes: remake the folder")
    return {
        identity: _issue(folder, ca_cert, ca_key, identity, NODE, node, hosts)
        for node, identity in zip(nodes, identities, strict=True)
    }


def _issue(
    folder: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    identity: str,
    role: str,
    common_name: str,
    hosts: Sequence[str],
) -> CertPaths:
    """Write ``<identity>.pem`` and ``.key``: a server and client certificate for ``hosts``, signed by the CA."""
    if role not in ROLES:
        raise ValueError(f"unknown certificate role {role!r}: use one of {list(ROLES)}")
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, role))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=_VALID_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san([*hosts, node_server_name(common_name)] if role == NODE else hosts), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    entry = CertPaths(folder, identity)
    entry.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(entry.key, key)
    return entry
