"""TLS for every connection kvroute makes or accepts: the settings' rules and the credentials built from them.

Two sections of the configuration: ``grpc_tls`` (the sidecar's gRPC server: certificate and key,
and with a client CA, client certificates required = mTLS) and ``upstream_tls`` (kvroute's clients to
KVCM, workers and the master: a CA bundle, and optionally a client certificate). Nothing set means
plaintext.

:func:`grpc_tls_problems` and :func:`upstream_tls_problems` are pure: whether a file can be used is
asked of the functions passed in (the settings layer passes :func:`pem_file_problem`,
:func:`cert_key_problem` and :func:`ca_bundle_problem` when it loads a configuration to serve with;
without them only the shape of the settings is checked).
The builders read the files (blocking I/O: call them in a worker thread from trio).
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable

import grpc

from router.config import GrpcTlsConfig, UpstreamTlsConfig
from router.files import open_regular_file
from router.problems import Problem

# Why a file cannot be used (None: it can); e.g. pem_file_problem.
Unusable = Callable[[str], str | None]
# Why a certificate and a key cannot be used together (None: they can); e.g. cert_key_problem.
UnusablePair = Callable[[str, str], str | None]

log = logging.getLogger(__name__)

# PEM bundles are kilobytes; anything far larger is not one (and is not read into memory).
MAX_PEM_BYTES = 1 << 20
# The system's CA bundle holds every public root (some hundred kilobytes): read once, with more room.
MAX_SYSTEM_CA_BYTES = 8 << 20
_PEM_BEGIN = b"-----BEGIN "
# A PKCS#8 encrypted key, and the traditional PEM encryption header.
_ENCRYPTED_KEY_MARKERS = (b"ENCRYPTED PRIVATE KEY", b"Proc-Type: 4,ENCRYPTED")


def _no_passphrase() -> str:
    """OpenSSL's passphrase callback: never a prompt on the terminal (a server would wait at it)."""
    raise ssl.SSLError("the key is passphrase-protected: kvroute needs an unencrypted key")


def pem_file_problem(path: str) -> str | None:
    """Why ``path`` is not a readable PEM file (None when it is). Reads the file."""
    try:
        with open_regular_file(path) as file:
            data = file.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        return f"cannot read the file: {exc.strerror or exc}"
    if len(data) > MAX_PEM_BYTES:
        return f"larger than {MAX_PEM_BYTES} bytes: not a PEM file"
    if _PEM_BEGIN not in data:
        return "not a PEM file (no '-----BEGIN' line)"
    return None


def cert_key_problem(cert: str, key: str) -> str | None:
    """Why the certificate chain at ``cert`` and the private key at ``key`` cannot serve TLS together
    (None when they can): each must be what its name says, and the key the certificate's. Reads both."""
    try:
        with open_regular_file(key) as file:
            if any(marker in file.read(MAX_PEM_BYTES) for marker in _ENCRYPTED_KEY_MARKERS):
                return "the key is passphrase-protected: kvroute (and grpc) need an unencrypted key"
    except OSError as exc:
        return f"cannot read the key: {exc.strerror or exc}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase)
    except ssl.SSLError as exc:
        return f"the certificate and key cannot be used together: {exc.reason or exc}"
    except OSError as exc:
        return f"cannot read the certificate or the key: {exc.strerror or exc}"
    return None


def ca_bundle_problem(path: str) -> str | None:
    """Why ``path`` is not a bundle of CA certificates (None when it is). Reads the file."""
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        return f"{path}: not a bundle of CA certificates: {exc.reason or exc}"
    except OSError as exc:
        return f"{path}: cannot read the file: {exc.strerror or exc}"
    return None


def _pair_problems(cert: str, key: str) -> list[Problem]:
    if key and not cert:
        return [Problem(("key", "cert"), "a private key without its certificate: set the certificate too")]
    if cert and not key:
        return [Problem(("cert", "key"), "a certificate without its private key: set the key too")]
    return []


def _file_problems(paths: dict[str, str], secret: frozenset[str], unusable: Unusable | None) -> list[Problem]:
    if unusable is None:
        return []
    problems: list[Problem] = []
    for name, path in paths.items():
        why = unusable(path) if path else None
        if why is not None:
            # The path of a secret is not repeated (the operator knows what was given).
            problems.append(Problem((name,), why if name in secret else f"{path}: {why}"))
    return problems


def _content_problems(
    cert: str, key: str, ca: tuple[str, str], pair: UnusablePair | None, bundle: Unusable | None
) -> list[Problem]:
    """Once each file is a readable PEM file: whether the key is the certificate's and the CA file a
    bundle of certificates (``ca``: its field and path)."""
    problems: list[Problem] = []
    if pair is not None and cert and key and (why := pair(cert, key)) is not None:
        problems.append(Problem(("cert", "key"), why))
    field, path = ca
    if bundle is not None and path and (why := bundle(path)) is not None:
        problems.append(Problem((field,), why))
    return problems


def grpc_tls_problems(
    config: GrpcTlsConfig,
    unusable: Unusable | None = None,
    pair: UnusablePair | None = None,
    bundle: Unusable | None = None,
) -> list[Problem]:
    """Every reason the sidecar's server cannot use ``config`` (empty: it can, or it is off)."""
    problems = _pair_problems(config.cert, config.key)
    if config.client_ca and not config.cert:
        problems.append(
            Problem(("client_ca", "cert"), "client certificates can only be required over TLS: set cert and key")
        )
    paths = {"cert": config.cert, "key": config.key, "client_ca": config.client_ca}
    problems += _file_problems(paths, frozenset({"key"}), unusable)
    if problems:
        return problems
    return _content_problems(config.cert, config.key, ("client_ca", config.client_ca), pair, bundle)


def upstream_tls_problems(
    config: UpstreamTlsConfig,
    unusable: Unusable | None = None,
    pair: UnusablePair | None = None,
    bundle: Unusable | None = None,
) -> list[Problem]:
    """Every reason kvroute's clients cannot use ``config`` (empty: they can, or it is off)."""
    paths = {"ca": config.ca, "cert": config.cert, "key": config.key}
    problems = _pair_problems(config.cert, config.key) + _file_problems(paths, frozenset({"key"}), unusable)
    if problems:
        return problems
    return _content_problems(config.cert, config.key, ("ca", config.ca), pair, bundle)


def _read(path: str, setting: str) -> bytes:
    """The file's bytes; an OSError names the setting (``section.field``), and a key's path is not repeated."""
    try:
        with open_regular_file(path) as file:
            return file.read(MAX_PEM_BYTES)
    except OSError as exc:
        shown = "" if setting.endswith(".key") else f" {path}:"
        raise OSError(f"{setting}:{shown} cannot read the file: {exc.strerror or exc}") from None


def _read_optional(path: str, setting: str) -> bytes | None:
    return _read(path, setting) if path else None


def server_credentials(config: GrpcTlsConfig) -> grpc.ServerCredentials | None:
    """The sidecar's server credentials (None: plaintext). Reads the files; raises OSError."""
    if not config.cert:
        return None
    ca = _read_optional(config.client_ca, "grpc_tls.client_ca")
    pair = (_read(config.key, "grpc_tls.key"), _read(config.cert, "grpc_tls.cert"))
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def system_ca_bundle() -> bytes | None:
    """The system's CA bundle, as the HTTP clients' default SSL context trusts it: OpenSSL's default CA
    file (``SSL_CERT_FILE`` when set). None when there is no usable one (no such file, unreadable, or
    past MAX_SYSTEM_CA_BYTES), and grpc's own default roots stand in: logged, since they are other
    CAs. A directory of certificates (``SSL_CERT_DIR``) is the HTTPS client's alone: grpc takes one
    bundle. Reads the file."""
    paths = ssl.get_default_verify_paths()
    if os.environ.get(paths.openssl_capath_env):
        log.warning(
            "%s=%s: its certificates check the HTTPS scheduler's only; the gRPC channels check the CA "
            "file (give --upstream-tls-ca to check both against one bundle)",
            paths.openssl_capath_env,
            os.environ[paths.openssl_capath_env],
        )
    path = paths.cafile  # the environment's override first, None if no such file
    if path is None:
        tried = os.environ.get(paths.openssl_cafile_env) or paths.openssl_cafile  # the one OpenSSL looked for
        log.warning("no system CA file (%s): the gRPC channels check servers against grpc's own roots", tried)
        return None
    try:
        with open_regular_file(path) as file:
            data = file.read(MAX_SYSTEM_CA_BYTES + 1)
    except OSError as exc:
        log.warning("system CA file %s: %s: the gRPC channels check servers against grpc's own roots", path, exc)
        return None
    # Cut short, the bundle's last certificate would be broken: grpc's default is the lesser surprise.
    if len(data) > MAX_SYSTEM_CA_BYTES:
        log.warning(
            "system CA file %s: larger than %d bytes: the gRPC channels check servers against grpc's own roots",
            path,
            MAX_SYSTEM_CA_BYTES,
        )
        return None
    return data


def channel_credentials(config: UpstreamTlsConfig) -> grpc.ChannelCredentials | None:
    """Credentials for kvroute's gRPC channels (None: plaintext). Reads the files; raises OSError."""
    if not config.enabled:
        return None
    # Without a CA, the system's bundle: grpc's own default is the roots.pem it ships (or
    # GRPC_DEFAULT_SSL_ROOTS_FILE_PATH), which would trust other CAs than the HTTPS client does.
    roots = _read(config.ca, "upstream_tls.ca") if config.ca else system_ca_bundle()
    return grpc.ssl_channel_credentials(
        root_certificates=roots,
        private_key=_read_optional(config.key, "upstream_tls.key"),
        certificate_chain=_read_optional(config.cert, "upstream_tls.cert"),
    )


def client_ssl_context(config: UpstreamTlsConfig) -> ssl.SSLContext | None:
    """An SSL context for kvroute's HTTP clients (None: plaintext). Reads the files; raises OSError/SSLError."""
    if not config.enabled:
        return None
    context = ssl.create_default_context(cafile=config.ca or None)
    if config.cert:
        context.load_cert_chain(config.cert, config.key, password=_no_passphrase)
    return context
