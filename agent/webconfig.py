"""``--web.config.file``: TLS and basic auth in the format of the Prometheus exporters' web config.

The file is the exporter-toolkit's (docs/web-configuration.md there), so one file and one habit serve
node_exporter and gpuwatch alike::

    tls_server_config:
      cert_file: /etc/gpuwatch/tls.crt
      key_file: /etc/gpuwatch/tls.key
      client_auth_type: RequireAndVerifyClientCert   # optional, with client_ca_file
      client_ca_file: /etc/gpuwatch/ca.crt
      min_version: TLS12
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2y$10$...   # bcrypt hash, e.g. htpasswd -nBC 10 "" | tr -d ':\\n'

What Python's ``ssl`` cannot do the way Go's crypto/tls does (Go cipher-suite and curve names, the
client auth types that ask for a certificate but never verify it, SAN allow-lists, rate limits) is
refused with a clear error rather than silently ignored: a security setting that is not applied
must not look applied. The file is read once at start-up (restart the agent to rotate certificates).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
import logging
import os
import re
import ssl
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import bcrypt
import yaml

log = logging.getLogger(__name__)

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: Go's tls.ClientAuthType names that ssl can honour; RequestClientCert and RequireAnyClientCert accept
#: unverified certificates, which the exporter-toolkit itself calls insecure.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
#: Response headers the exporter-toolkit lets a web config set, with their allowed values (None: any).
EXTRA_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_TLS_KEYS = {"cert_file", "key_file", "cert", "key", "client_auth_type", "client_ca_file", "client_ca",
             "min_version", "max_version", "prefer_server_cipher_suites"}
#: exporter-toolkit keys that have no faithful equivalent here.
_UNSUPPORTED = {
    "cipher_suites": "Go cipher suite names have no faithful OpenSSL mapping; leave it out to get OpenSSL's "
                     "secure defaults",
    "curve_preferences": "Python's ssl cannot set a curve preference list",
    "client_allowed_sans": "SAN allow-lists are not implemented; use a dedicated client CA instead",
    "rate_limit": "rate limiting is not implemented",
}
_BCRYPT_HASH = re.compile(rb"^\$2[abxy]?\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")
#: Checked when the user is unknown, so a wrong user name costs the same time as a wrong password (no
#: user enumeration by timing). bcrypt of "gpuwatch: no such user"; the outcome is ignored anyway.
_DUMMY_HASH = b"$2b$10$vGfwX1yzofPhQkIZBnaMqeHeEy.LLOvloc1RfHeLjeNOtFLVAX.pO"
#: Verified (user, password) outcomes kept: bcrypt costs ~70 ms at cost 10, every scrape would pay it.
CACHE_ENTRIES = 100


class WebConfigError(Exception):
    """The web config is unusable; the message names the file and what to fix."""


@dataclasses.dataclass(frozen=True)
class WebConfig:
    """What the HTTP server applies: a server TLS context (None: plain HTTP), basic auth users
    (None: no auth) and extra response headers."""

    tls: ssl.SSLContext | None = None
    auth: BasicAuth | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


class BasicAuth:
    """Checks ``Authorization: Basic`` headers against bcrypt hashes, as the exporter-toolkit does:
    an unknown user costs a bcrypt check too, one check runs at a time (bcrypt is CPU-bound), and
    outcomes are cached by a SHA-256 of user, hash and password, never the password itself."""

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self._users = dict(users)
        self._cache: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()

    def check(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value grants access."""
        credentials = _basic_credentials(authorization)
        if credentials is None:
            return False
        user, password = credentials
        hashed = self._users.get(user)
        known = hashed is not None
        if hashed is None:
            hashed = _DUMMY_HASH
        key = hashlib.sha256(b":".join(part.hex().encode() for part in (user.encode(), hashed, password))).digest()
        with self._cache_lock:
            granted = self._cache.get(key)
        if granted is None:
            with self._bcrypt_lock:
                try:
                    granted = bcrypt.checkpw(password, hashed)
                except ValueError:  # longer than bcrypt's 72 bytes: no hash can match it
                    granted = False
            with self._cache_lock:
                self._cache[key] = granted
                if len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return known and granted


def _basic_credentials(authorization: str | None) -> tuple[str, bytes] | None:
    if not authorization:
        return None
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    return user.decode("utf-8", "replace"), password


def load(path: Path) -> WebConfig:
    """Parse and check a web config file; relative file names are relative to the file's directory."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise WebConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WebConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    try:
        return _parse(document or {}, path.parent)
    except WebConfigError as exc:
        raise WebConfigError(f"{path}: {exc}") from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise WebConfigError(f"{where} must be a mapping")
    return value


def _check_keys(section: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in section:
        if key in _UNSUPPORTED:
            raise WebConfigError(f"{where}{key} is not supported by gpuwatch: {_UNSUPPORTED[key]}")
        if key not in allowed:
            raise WebConfigError(f"unknown key {where}{key} (known: {', '.join(sorted(allowed))})")


def _parse(document: Any, base: Path) -> WebConfig:
    document = _mapping(document, "the file")
    _check_keys(document, {"tls_server_config", "http_server_config", "basic_auth_users"}, "")
    http = _mapping(document.get("http_server_config"), "http_server_config")
    _check_keys(http, {"http2", "headers"}, "http_server_config.")
    _check_types({"http2": http.get("http2")}, "http_server_config.", frozenset({"http2"}))
    headers = _headers(_mapping(http.get("headers"), "http_server_config.headers"))
    users = _users(_mapping(document.get("basic_auth_users"), "basic_auth_users"))
    tls_section = document.get("tls_server_config")
    tls = None if tls_section is None else _tls(_mapping(tls_section, "tls_server_config"), base)
    if users and tls is None:
        log.warning("basic auth without tls_server_config: passwords cross the network in clear text")
    return WebConfig(tls=tls, auth=BasicAuth(users) if users else None, headers=headers)


def _headers(headers: dict[str, Any]) -> dict[str, str]:
    for name, value in headers.items():
        if name not in EXTRA_HEADERS:
            raise WebConfigError(f"HTTP header {name!r} cannot be configured (allowed: "
                                 f"{', '.join(EXTRA_HEADERS)})")
        allowed = EXTRA_HEADERS[name]
        if not isinstance(value, str) or (allowed is not None and value not in allowed):
            raise WebConfigError(f"invalid value {value!r} for header {name}"
                                 + (f" (one of: {', '.join(allowed)})" if allowed else " (a string)"))
    return {name: value for name, value in headers.items() if value}


def _users(users: dict[str, Any]) -> dict[str, bytes]:
    hashes = {}
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not _BCRYPT_HASH.match(hashed.encode()):
            raise WebConfigError(f"basic_auth_users.{user} is not a bcrypt hash ($2y$10$ followed by 53 "
                                 "characters; make one with htpasswd -nBC 10 \"\" | tr -d ':\\n')")
        hashes[user] = hashed.encode()
    return hashes


def _pem(section: dict[str, Any], inline: str, file_key: str, base: Path) -> tuple[str | None, str | None]:
    """(file name, inline PEM) of one certificate/key entry; at most one of them may be given."""
    if section.get(inline) and section.get(file_key):
        raise WebConfigError(f"tls_server_config: give {inline} or {file_key}, not both")
    if section.get(file_key):
        path = base / section[file_key]
        if not path.is_file():
            raise WebConfigError(f"tls_server_config.{file_key}: {path} does not exist")
        return str(path), None
    return None, section.get(inline) or None


def _check_types(section: dict[str, Any], where: str, booleans: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The section without its empty (null) entries, each of the type the format gives it."""
    section = {key: value for key, value in section.items() if value is not None}
    for key, value in section.items():
        expected = bool if key in booleans else str
        if not isinstance(value, expected):
            raise WebConfigError(f"{where}{key} must be a {'boolean' if expected is bool else 'string'}, "
                                 f"not {value!r}")
    return section


def _tls(section: dict[str, Any], base: Path) -> ssl.SSLContext:
    _check_keys(section, _TLS_KEYS, "tls_server_config.")
    section = _check_types(section, "tls_server_config.", frozenset({"prefer_server_cipher_suites"}))
    cert_file, cert = _pem(section, "cert", "cert_file", base)
    key_file, key = _pem(section, "key", "key_file", base)
    if not (cert_file or cert):
        raise WebConfigError("tls_server_config: missing cert_file (or cert)")
    if not (key_file or key):
        raise WebConfigError("tls_server_config: missing key_file (or key)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _version(section, "min_version", "TLS12")
    context.maximum_version = _version(section, "max_version", "TLS13")
    if context.minimum_version > context.maximum_version:
        raise WebConfigError("tls_server_config: min_version is above max_version")
    if section.get("prefer_server_cipher_suites", True):
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        _load_chain(context, cert_file, cert, key_file, key)
    except (ssl.SSLError, OSError) as exc:
        raise WebConfigError(f"tls_server_config: cannot load the certificate and key: {exc}") from None

    auth_type = section.get("client_auth_type", "NoClientCert")
    if auth_type not in CLIENT_AUTH:
        known = "RequestClientCert", "RequireAnyClientCert"
        why = " (it accepts certificates it never verifies)" if auth_type in known else ""
        raise WebConfigError(f"tls_server_config.client_auth_type {auth_type!r} is not supported{why}: use one of "
                             f"{', '.join(CLIENT_AUTH)}")
    ca_file, ca = _pem(section, "client_ca", "client_ca_file", base)
    if (ca_file or ca) and auth_type == "NoClientCert":
        raise WebConfigError("tls_server_config: client_ca_file is set but client_auth_type is NoClientCert")
    if auth_type != "NoClientCert":
        if not (ca_file or ca):
            raise WebConfigError(f"tls_server_config: client_auth_type {auth_type} needs client_ca_file")
        try:
            context.load_verify_locations(cafile=ca_file, cadata=ca)
        except (ssl.SSLError, OSError) as exc:
            raise WebConfigError(f"tls_server_config: cannot load the client CA: {exc}") from None
        context.verify_mode = CLIENT_AUTH[auth_type]
    return context


def _version(section: dict[str, Any], key: str, default: str) -> ssl.TLSVersion:
    name = section.get(key, default)
    if name not in TLS_VERSIONS:
        raise WebConfigError(f"tls_server_config.{key} {name!r} is not one of {', '.join(TLS_VERSIONS)}")
    return TLS_VERSIONS[name]


def _load_chain(context: ssl.SSLContext, cert_file: str | None, cert: str | None, key_file: str | None,
                key: str | None) -> None:
    """load_cert_chain takes file names only: inline PEM goes through a private temporary file."""
    with tempfile.TemporaryDirectory(prefix="gpuwatch-tls-") as directory:
        def materialise(name: str, pem: str | None, path: str | None) -> str | None:
            if pem is None:
                return path
            target = os.path.join(directory, name)  # the directory is 0700: the key stays private
            with open(target, "w") as handle:
                handle.write(pem)
            return target

        certfile = materialise("cert.pem", cert, cert_file)
        assert certfile is not None, "_tls rejects a config without cert_file or cert"
        context.load_cert_chain(certfile, materialise("key.pem", key, key_file))
