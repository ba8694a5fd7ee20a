"""Mutual TLS for the control plane: a local CA, certificates, credentials and the auth interceptor.

Every server (coordinator, node daemon) requires a client certificate signed
by the cluster CA: a peer without one, or with one from another CA, fails the
TLS handshake and no RPC reaches the service. Past the handshake, the
:class:`AuthInterceptor` checks the certificate's role (the first
organizational unit of its subject) and, for what a node says about itself,
its name (the common name):

- ``admin`` (``admin.pem``): the client commands on the coordinator (submit,
  runs, cancel, resume); nothing on the daemons.
- ``coordinator`` (``coordinator.pem``): the coordinator serves with it and
  is the only caller a daemon accepts (pushes, stops, status, metrics).
- ``node`` (``node-<ID>.pem``, common name ``<ID>``): one per daemon; may
  register and heartbeat on the coordinator only as node ``<ID>``.

A wrong role gets UNAUTHENTICATED naming the roles needed; a node certificate
speaking for another node gets PERMISSION_DENIED naming the node it is for.
``octopipe certs make DIR --nodes ID ...`` writes a CA and certificates for a
cluster; ``octopipe certs node DIR ID ...`` adds node certificates later.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "ADMIN",
    "COORDINATOR",
    "MAX_MESSAGE_BYTES",
    "NODE",
    "ROLES",
    "AuthInterceptor",
    "CertPaths",
    "Claims",
    "add_node_certs",
    "ca_key_folder",
    "channel_options",
    "copy_identity",
    "describe_certs",
    "make_certs",
    "node_identity",
    "node_server_name",
    "require_identity",
    "secure_channel",
    "server_credentials",
]

#: The largest message any server or client accepts (a Plan for 8k ranks is a few MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Certificate roles (the subject's organizational unit) the interceptor knows.
ADMIN, COORDINATOR, NODE = "admin", "coordinator", "node"
ROLES = (ADMIN, COORDINATOR, NODE)
#: What a request says about which nodes it speaks for: full method name -> the node ids in a request.
Claims = Mapping[str, Callable[[Any], Iterable[str]]]
_CA = "ca"
_NODE_PREFIX = "node-"
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_VALID_DAYS = 30


@dataclass(frozen=True)
class CertPaths:
    """The files of one identity in a certificate folder: ``<name>.pem``, ``<name>.key`` and the CA's ``ca.pem``."""

    folder: Path
    name: str

    @property
    def ca(self) -> Path:
        return self.folder / f"{_CA}.pem"

    @property
    def cert(self) -> Path:
        return self.folder / f"{self.name}.pem"

    @property
    def key(self) -> Path:
        return self.folder / f"{self.name}.key"

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificate, certificate, private key) as PEM; a missing file is named with what to do."""
        for path in (self.ca, self.cert, self.key):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing (identity {self.name!r}): {self._hint(path)}")
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()

    def subject(self) -> tuple[str | None, str | None]:
        """(role, common name) of the certificate."""
        _, cert, _ = self.read()
        return _subject(x509.load_pem_x509_certificate(cert))

    def _hint(self, path: Path) -> str:
        node = self.name.removeprefix(_NODE_PREFIX)
        if path == self.ca or node == self.name:
            return f"make the cluster's certificates with `octopipe certs make {self.folder}`"
        return (
            f"make node {node}'s certificate with `octopipe certs node {self.folder} {node} --hosts ADDRESS...` "
            f"(signed by the CA already in {self.folder}), or a new cluster's with "
            f"`octopipe certs make {self.folder} --nodes {node}`"
        )


def node_identity(node_id: str) -> str:
    """The identity (file stem in a certificate folder) of node ``node_id``: ``node-<node_id>``."""
    if not _NODE_ID.fullmatch(node_id):
        raise ValueError(
            f"node id {node_id!r} cannot name a certificate: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or a digit"
        )
    return _NODE_PREFIX + node_id


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
        role, name = _subject(cert)
        found.append((pem.stem, role, name, cert.not_valid_after_utc))
    return found


def require_identity(identity: CertPaths, role: str, name: str | None = None) -> None:
    """Raise ValueError unless ``identity``'s certificate has ``role`` (and, given, common name ``name``) and
    has not expired."""
    _, cert_pem, _ = identity.read()
    expires = x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
    if expires <= datetime.datetime.now(datetime.UTC):
        raise ValueError(
            f"{identity.cert} expired on {expires:%Y-%m-%d %H:%M} UTC: make new certificates (`octopipe certs make "
            f"{identity.folder} --force`, or `octopipe certs node` for a node)"
        )
    has_role, has_name = identity.subject()
    if has_role == role and (name is None or has_name == name):
        return
    wanted = f"role {role!r}" + ("" if name is None else f" and name {name!r}")
    if role == NODE and name is not None:
        fix = (
            f"use node {name}'s own certificate (--identity {node_identity(name)}, the default for --node-id {name}; "
            f"`octopipe certs node {identity.folder} {name}` makes it)"
        )
    else:
        fix = f"remake the folder with `octopipe certs make {identity.folder}` (older folders had no role {role!r})"
    raise ValueError(f"{identity.cert} has role {has_role!r} and name {has_name!r}, but this needs {wanted}: {fix}")


def _subject(cert: x509.Certificate) -> tuple[str | None, str | None]:
    """(role, common name): the first organizational unit and common name of the subject."""

    def first(oid: x509.ObjectIdentifier) -> str | None:
        values = cert.subject.get_attributes_for_oid(oid)
        value = values[0].value if values else None
        return value if isinstance(value, str) else None

    return first(NameOID.ORGANIZATIONAL_UNIT_NAME), first(NameOID.COMMON_NAME)


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


def server_credentials(identity: CertPaths) -> grpc.ServerCredentials:
    """TLS server credentials that require a client certificate signed by the CA."""
    ca, cert, key = identity.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_options() -> list[tuple[str, Any]]:
    """Message size bounds shared by every server and channel."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # reconnect fast after a peer restarts (heartbeats resume within about a second)
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def node_server_name(node_id: str) -> str:
    """The name a node's certificate also carries (a DNS SAN): the coordinator connects to node ``node_id``'s
    daemon expecting it, so an address registered for one node cannot reach another node's daemon."""
    return f"{node_id}.node.octopipe"


def secure_channel(target: str, identity: CertPaths, *, server_name: str | None = None) -> grpc.Channel:
    """A mutual-TLS channel to ``target`` (host:port) authenticated as ``identity``.

    ``server_name``: the name the server's certificate must carry (default: ``target``'s host)."""
    ca, cert, key = identity.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options = channel_options()
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(target, credentials, options=options)


def _peer(context: grpc.ServicerContext) -> tuple[str | None, str | None]:
    """(role, common name) of the verified peer certificate; (None, None) without one."""
    pems: Any = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        return None, None
    try:
        return _subject(x509.load_pem_x509_certificate(bytes(pems[0])))
    except ValueError:
        return None, None


class AuthInterceptor(grpc.ServerInterceptor):
    """Lets a call through only when the peer's certificate role may call that method.

    ``allowed`` maps a full method name (``/pkg.Service/Method``) to the roles
    that may call it; methods not listed are open to every role the CA signed
    (health checks). A refused call gets UNAUTHENTICATED naming the role.
    ``claims`` maps some of those methods to the node ids a request speaks
    for: each non-empty one must be the caller's certificate name, else
    PERMISSION_DENIED naming the node the certificate is for.
    """

    def __init__(self, allowed: dict[str, frozenset[str]], claims: Claims | None = None) -> None:
        unguarded = sorted(set(claims or {}) - set(allowed))
        if unguarded:
            raise ValueError(f"claims for {unguarded} need roles in `allowed` too")
        self._allowed = allowed
        self._claims = dict(claims or {})

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        roles = self._allowed.get(method)
        if handler is None or roles is None:
            return handler
        return _guard(handler, roles, method, self._claims.get(method))


def _guard(
    handler: grpc.RpcMethodHandler,
    roles: frozenset[str],
    method: str,
    claims: Callable[[Any], Iterable[str]] | None,
) -> grpc.RpcMethodHandler:
    def check(request: Any, context: grpc.ServicerContext) -> None:
        role, name = _peer(context)
        if role not in roles:
            structlog.get_logger("octopipe.auth").warning(
                "rpc_refused", method=method, role=role, name=name, needs=sorted(roles)
            )
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a certificate with role {sorted(roles)}; the caller's role is {role!r}",
            )
        for claimed in claims(request) if claims is not None else ():
            if claimed and claimed != name:
                structlog.get_logger("octopipe.auth").warning(
                    "rpc_refused", method=method, role=role, name=name, claimed_node=claimed
                )
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} speaks for node {claimed!r}, but the caller's certificate names node {name!r}: "
                    f"a daemon may speak only for its own node (start it with --node-id {name}, or give it node "
                    f"{claimed}'s certificate: `octopipe certs node DIR {claimed}`)",
                )

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            check(request, context)
            return inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            check(request, context)
            yield from inner_us(request, context)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    raise TypeError(f"{method}: only unary and server-streaming methods are guarded")
