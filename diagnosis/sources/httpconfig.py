"""``--http.config.file``: how diagnose reaches a PromQL engine behind authentication, in Prometheus' own HTTP
client config format (the file promtool's ``--http.config.file`` reads), so that operators reuse the file they
already have for Thanos, Mimir or VictoriaMetrics::

    basic_auth: {username: diag, password_file: /etc/gpuwatch/promql.pass}   # or password:
    authorization: {type: Bearer, credentials_file: /etc/gpuwatch/token}     # or credentials:
    tls_config: {ca_file: ca.crt, cert_file: client.crt, key_file: client.key, server_name: prom.example,
                 insecure_skip_verify: false}
    http_headers:
      X-Scope-OrgID: {values: [team-a]}                                       # or secrets:, files:

The YAML is parsed by PyYAML; only the mapping onto a request is written here. Relative file names are relative
to the config file, as Prometheus reads them. What ``urllib`` cannot honour the way Go's client does (a proxy,
OAuth 2, TLS version pins) is refused with a clear error rather than ignored: an access setting that is not applied
must not look applied. Credentials are kept in ``HttpConfig.secrets`` so that every message can be scrubbed of
them (``redact``): they are never printed, not even in errors.
"""

from __future__ import annotations

import base64
import dataclasses
import ssl
from pathlib import Path
from typing import Any

import yaml


class HttpConfigError(Exception):
    """A config file that cannot be read or says something this client cannot honour; one line for people."""


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    """Headers every request carries (authorization, tenant), the TLS context for https, and the secret values
    no message may show."""

    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    tls: ssl.SSLContext | None = None
    secrets: tuple[str, ...] = ()

    def redact(self, text: str) -> str:
        """``text`` with every credential replaced: error bodies of proxies may echo what they were sent."""
        for secret in sorted(self.secrets, key=len, reverse=True):
            if secret:
                text = text.replace(secret, "<secret>")
        return text


#: Keys accepted and applied; ``follow_redirects`` and ``enable_http2`` are Go client switches with no effect on
#: what diagnose may read (urllib follows redirects and speaks HTTP/1.1), so they are accepted as written.
_TOP = {"basic_auth", "authorization", "bearer_token", "bearer_token_file", "tls_config", "http_headers",
        "follow_redirects", "enable_http2"}
_REFUSED = {"oauth2": "OAuth 2", "proxy_url": "a proxy", "proxy_from_environment": "a proxy",
            "proxy_connect_header": "a proxy", "no_proxy": "a proxy"}
_TLS = {"ca_file", "cert_file", "key_file", "server_name", "insecure_skip_verify", "ca", "cert", "key"}


def load(path: Path) -> HttpConfig:
    """The config in ``path``; every problem is an HttpConfigError naming the key (never its value)."""
    try:
        document = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise HttpConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise HttpConfigError(f"{path} is not valid YAML{where}") from None  # PyYAML quotes the text: no secrets
    return _Parser(Path(path)).parse(document)


class _Parser:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.secrets: list[str] = []

    def fail(self, message: str) -> HttpConfigError:
        return HttpConfigError(f"{self.path}: {message}")

    def mapping(self, value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} must be a mapping")
        for key in value:
            if key in _REFUSED:
                raise self.fail(f"{where}{key}: {_REFUSED[key]} is not supported by gpuwatch diagnose")
            if key not in allowed:
                raise self.fail(f"unknown key {where}{key} (known: {', '.join(sorted(allowed))})")
        return value

    def text(self, section: dict[str, Any], key: str, where: str) -> str | None:
        value = section.get(key)
        if value is not None and not isinstance(value, str):
            raise self.fail(f"{where}{key} must be a string")
        return value

    def file(self, name: str, where: str) -> str:
        """A secret file's content without the trailing newline (as Prometheus trims it)."""
        path = self.resolve(name)
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise self.fail(f"{where}: cannot read {path}: {exc.strerror or exc}") from None

    def resolve(self, name: str) -> Path:
        path = Path(name)
        return path if path.is_absolute() else self.path.parent / path

    def secret(self, section: dict[str, Any], inline: str, file_key: str, where: str) -> str | None:
        value, name = self.text(section, inline, where), self.text(section, file_key, where)
        if value is not None and name is not None:
            raise self.fail(f"{where}{inline} and {where}{file_key} are mutually exclusive")
        if name is not None:
            value = self.file(name, f"{where}{file_key}")
        if value is not None:
            self.secrets.append(value)
        return value

    def parse(self, document: Any) -> HttpConfig:
        top = self.mapping(document, "", _TOP | set(_REFUSED))
        headers: dict[str, str] = {}
        auth = []
        if "basic_auth" in top:
            section = self.mapping(top["basic_auth"], "basic_auth.",
                                   {"username", "username_file", "password", "password_file"})
            user = self.secret(section, "username", "username_file", "basic_auth.") or ""
            password = self.secret(section, "password", "password_file", "basic_auth.") or ""
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.secrets.append(token)
            headers["Authorization"] = f"Basic {token}"
            auth.append("basic_auth")
        if "authorization" in top:
            section = self.mapping(top["authorization"], "authorization.", {"type", "credentials", "credentials_file"})
            kind = self.text(section, "type", "authorization.") or "Bearer"
            if kind.lower() == "basic":
                raise self.fail("authorization.type Basic is not allowed: use basic_auth")
            credentials = self.secret(section, "credentials", "credentials_file", "authorization.") or ""
            headers["Authorization"] = f"{kind} {credentials}"
            auth.append("authorization")
        if "bearer_token" in top or "bearer_token_file" in top:  # the older spelling of authorization
            token = self.secret(top, "bearer_token", "bearer_token_file", "") or ""
            headers["Authorization"] = f"Bearer {token}"
            auth.append("bearer_token")
        if len(auth) > 1:
            raise self.fail(f"at most one of basic_auth, authorization and bearer_token may be set (got "
                            f"{', '.join(auth)})")
        for name, value in self.headers(top.get("http_headers") or {}).items():
            if name.lower() == "authorization" and auth:
                raise self.fail("http_headers.Authorization conflicts with " + auth[0])
            headers[name] = value
        tls = self.tls(top.get("tls_config")) if "tls_config" in top else None
        return HttpConfig(headers, tls, tuple(self.secrets))

    def headers(self, section: Any) -> dict[str, str]:
        """``http_headers``: each header's ``values``, ``secrets`` (redacted) and ``files`` (read), joined as one
        comma-separated value as HTTP allows for repeated headers."""
        out = {}
        for name, spec in self.mapping(section, "http_headers.", set(section) if isinstance(section, dict)
                                       else set()).items():
            where = f"http_headers.{name}."
            spec = self.mapping(spec, where, {"values", "secrets", "files"})
            values: list[str] = []
            for key in ("values", "secrets", "files"):
                items = spec.get(key) or []
                if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
                    raise self.fail(f"{where}{key} must be a list of strings")
                read = [self.file(item, f"{where}files") for item in items] if key == "files" else items
                if key != "values":
                    self.secrets.extend(read)
                values += read
            out[str(name)] = ", ".join(values)
        return out

    def tls(self, section: Any) -> ssl.SSLContext:
        tls = self.mapping(section, "tls_config.", _TLS)
        for inline in ("ca", "cert", "key"):
            if inline in tls:
                raise self.fail(f"tls_config.{inline} (inline PEM) is not supported: use tls_config.{inline}_file")
        skip = tls.get("insecure_skip_verify", False)
        if not isinstance(skip, bool):
            raise self.fail("tls_config.insecure_skip_verify must be true or false")
        context = _Context(ssl.PROTOCOL_TLS_CLIENT)
        ca_file = self.text(tls, "ca_file", "tls_config.")
        cert_file, key_file = self.text(tls, "cert_file", "tls_config."), self.text(tls, "key_file", "tls_config.")
        if (cert_file is None) != (key_file is None):
            raise self.fail("tls_config.cert_file and tls_config.key_file must be given together")
        try:
            if ca_file is not None:
                context.load_verify_locations(cafile=str(self.resolve(ca_file)))
            else:
                context.load_default_certs()
            if cert_file is not None and key_file is not None:
                context.load_cert_chain(str(self.resolve(cert_file)), str(self.resolve(key_file)))
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__
            raise self.fail(f"tls_config: cannot load the CA, certificate or key: {reason}") from None
        if skip:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.server_name = self.text(tls, "server_name", "tls_config.")
        return context


class _Context(ssl.SSLContext):
    """A client context that, given ``server_name``, checks the server's certificate against it (and sends it as
    SNI) instead of the URL's host, as Go's ``tls.Config.ServerName``: an engine reached by address whose
    certificate names it."""

    server_name: str | None = None

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        if self.server_name:
            kwargs["server_hostname"] = self.server_name
        return super().wrap_socket(sock, *args, **kwargs)
