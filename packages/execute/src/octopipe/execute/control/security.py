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
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog

if TYPE_CHECKING:  # cryptography loads only where certificates are read (servers) or made (certs)
    from cryptography import x509

__all__ = [
    "ADMIN",
    "COORDINATOR",
    "MAX_MESSAGE_BYTES",
    "NODE",
    "ROLES",
    "AuthInterceptor",
    "CertPaths",
    "Claims",
    "channel_options",
    "node_identity",
    "node_server_name",
    "require_identity",
    "secure_channel",
    "server_credentials",
    "subject_of",
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
        from cryptography import x509  # noqa: PLC0415 (see the TYPE_CHECKING import)

        _, cert, _ = self.read()
        return subject_of(x509.load_pem_x509_certificate(cert))

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


def require_identity(identity: CertPaths, role: str, name: str | None = None) -> None:
    """Raise ValueError unless ``identity``'s certificate has ``role`` (and, given, common name ``name``) and
    has not expired."""
    from cryptography import x509  # noqa: PLC0415 (see the TYPE_CHECKING import)

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


def subject_of(cert: x509.Certificate) -> tuple[str | None, str | None]:
    """(role, common name): the first organizational unit and common name of the subject."""
    from cryptography.x509.oid import NameOID  # noqa: PLC0415 (see the TYPE_CHECKING import)

    def first(oid: x509.ObjectIdentifier) -> str | None:
        values = cert.subject.get_attributes_for_oid(oid)
        value = values[0].value if values else None
        return value if isinstance(value, str) else None

    return first(NameOID.ORGANIZATIONAL_UNIT_NAME), first(NameOID.COMMON_NAME)


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
    from cryptography import x509  # noqa: PLC0415 (see the TYPE_CHECKING import)

    pems: Any = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        return None, None
    try:
        return subject_of(x509.load_pem_x509_certificate(bytes(pems[0])))
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
