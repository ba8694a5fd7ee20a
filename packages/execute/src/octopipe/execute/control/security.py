"""Mutual TLS for the control plane: a local CA, certificates, credentials and the auth interceptor.

Every server (coordinator, node daemon) requires a client certificate signed
by the cluster CA: a peer without one, or with one from another CA, fails the
TLS handshake and no RPC reaches the service. Past the handshake, the
:class:`AuthInterceptor` checks the certificate's role (the first
organizational unit of its subject): ``admin`` may call everything, ``node``
may call what daemons and the coordinator call on each other, anything else
gets UNAUTHENTICATED. ``octopipe certs make DIR`` writes a CA and
certificates for a test cluster.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "MAX_MESSAGE_BYTES",
    "ROLES",
    "AuthInterceptor",
    "CertPaths",
    "channel_options",
    "make_certs",
    "secure_channel",
    "server_credentials",
]

#: The largest message any server or client accepts (a Plan for 8k ranks is a few MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Certificate roles (the subject's organizational unit) the interceptor knows.
ROLES = ("admin", "node")
_CA = "ca"
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
                raise FileNotFoundError(
                    f"{path} is missing: make the cluster's certificates with `octopipe certs make {self.folder}` "
                    f"(identity {self.name!r})"
                )
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()


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


def make_certs(
    folder: Path,
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    identities: Sequence[tuple[str, str]] = (("coordinator", "node"), ("node", "node"), ("admin", "admin")),
    ca_name: str = "octopipe test CA",
) -> dict[str, CertPaths]:
    """Write a CA and one certificate per (name, role) into ``folder``; every certificate serves and authenticates.

    Each certificate is valid for ``hosts`` (IP addresses or DNS names) as a
    server and carries its role for the interceptor. Returns the paths by name.
    """
    unknown = sorted({role for _, role in identities} - set(ROLES))
    if unknown:
        raise ValueError(f"unknown certificate roles {unknown}: use one of {list(ROLES)}")
    folder.mkdir(parents=True, exist_ok=True)
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
    _write_key(folder / f"{_CA}.key", ca_key)
    paths: dict[str, CertPaths] = {}
    for name, role in identities:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name, role))
            .issuer_name(ca_subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH, x509.ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        entry = CertPaths(folder, name)
        entry.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(entry.key, key)
        paths[name] = entry
    return paths


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


def secure_channel(target: str, identity: CertPaths) -> grpc.Channel:
    """A mutual-TLS channel to ``target`` (host:port) authenticated as ``identity``."""
    ca, cert, key = identity.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(target, credentials, options=channel_options())


def _role_of(context: grpc.ServicerContext) -> str | None:
    """The role (organizational unit) of the verified peer certificate, or None."""
    pems: Any = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        return None
    try:
        cert = x509.load_pem_x509_certificate(bytes(pems[0]))
        units = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    except ValueError:
        return None
    value = units[0].value if units else None
    return value if isinstance(value, str) else None


class AuthInterceptor(grpc.ServerInterceptor):
    """Lets a call through only when the peer's certificate role may call that method.

    ``allowed`` maps a full method name (``/pkg.Service/Method``) to the roles
    that may call it; methods not listed are open to every role the CA signed
    (health checks). A refused call gets UNAUTHENTICATED naming the role.
    """

    def __init__(self, allowed: dict[str, frozenset[str]]) -> None:
        self._allowed = allowed

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        roles = self._allowed.get(handler_call_details.method)
        if handler is None or roles is None:
            return handler
        return _guard(handler, roles, handler_call_details.method)


def _guard(handler: grpc.RpcMethodHandler, roles: frozenset[str], method: str) -> grpc.RpcMethodHandler:
    def check(context: grpc.ServicerContext) -> None:
        role = _role_of(context)
        if role not in roles:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a certificate with role {sorted(roles)}; the caller's role is {role!r}",
            )

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            yield from inner_us(request, context)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    raise TypeError(f"{method}: only unary and server-streaming methods are guarded")
