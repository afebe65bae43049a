"""--web.config.file: TLS and basic auth with real TLS clients (Python's ssl and a real Prometheus),
certificates made here with the cryptography package; bad configs are one-line errors."""

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpuwatch.agent import webconfig
from gpuwatch.agent.webconfig import BasicAuth, WebConfigError
from gpuwatch.cli.main import main

from conftest import AgentProcess, free_port, require_tool, wait_until

pytestmark = pytest.mark.integration

HOST_ONLY = ("--no-collector.nvml", "--no-collector.nvlink", "--no-collector.infiniband",
             "--no-collector.telemetry", "--interval", "0.5")
PASSWORD = "s3cret-scrape"
# Cost 4 keeps the tests fast; the agent accepts any cost bcrypt allows (4..31).
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


# -- certificates ---------------------------------------------------------------------------------

def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key, issuer_name: x509.Name | None, issuer_key, *, ca: bool = False,
                 server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_pki(directory: Path) -> dict[str, Path]:
    """A CA (ca.crt), a server certificate for 127.0.0.1/localhost (tls.crt, tls.key) and a client
    certificate (client.crt, client.key), as PEM files in ``directory``."""
    files = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("gpuwatch test CA", ca_key, None, ca_key, ca=True)
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _certificate(f"gpuwatch test {role}", key, ca.subject, ca_key, server=role == "server")
        prefix = "tls" if role == "server" else role  # cert-manager's names for the server's pair
        files[f"{prefix}.crt"] = certificate.public_bytes(serialization.Encoding.PEM)
        files[f"{prefix}.key"] = _key_pem(key)
    files["ca.crt"] = ca.public_bytes(serialization.Encoding.PEM)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return {name: directory / name for name in files}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return write_pki(tmp_path_factory.mktemp("pki"))


def _web_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _client_context(pki, *, client_cert: bool = False, maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca.crt"]))
    if client_cert:
        context.load_cert_chain(pki["client.crt"], pki["client.key"])
    if maximum is not None:
        context.maximum_version = maximum
    return context


def https_get(url: str, context: ssl.SSLContext, user: str | None = None,
              password: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


class TLSAgent(AgentProcess):
    """The agent started with a web config: ready once /healthz answers over TLS."""

    def __init__(self, *args: str, telemetry_socket: Path, context: ssl.SSLContext) -> None:
        self.context = context
        port = free_port()
        self.https = f"https://127.0.0.1:{port}"
        super().__init__(*args, telemetry_socket=telemetry_socket, port=port)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
        return https_get(self.https + "/healthz", self.context)[0] == 200


@pytest.fixture
def tls_agent(tmp_path):
    agents = []

    def start(config: dict, context: ssl.SSLContext) -> TLSAgent:
        agent = TLSAgent(*HOST_ONLY, "--web.config.file", str(_web_config(tmp_path, config)),
                         telemetry_socket=tmp_path / "t.sock", context=context)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()


def _tls(pki, **extra) -> dict:
    return {"tls_server_config": {"cert_file": str(pki["tls.crt"]), "key_file": str(pki["tls.key"]), **extra}}


# -- serving ----------------------------------------------------------------------------------------

def test_tls_serves_every_endpoint_and_only_to_clients_that_trust_the_ca(pki, tls_agent):
    agent = tls_agent({**_tls(pki), "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}}},
                      _client_context(pki))
    status, body, headers = https_get(agent.https + "/metrics", agent.context)
    assert status == 200 and b'gpuwatch_collector_up{collector="host"} 1.0' in body
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert json.loads(https_get(agent.https + "/api/v1/state", agent.context)[1])["collectors"]["host"]["up"]

    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        https_get(agent.https + "/metrics", ssl.create_default_context())  # the system CAs do not know ours
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP on a TLS port is no answer
        urllib.request.urlopen(agent.url + "/metrics", timeout=5)
    assert https_get(agent.https + "/metrics", agent.context)[0] == 200  # and it did not disturb the server


def test_failed_and_silent_handshakes_leak_no_connection_and_block_no_one(pki, tls_agent):
    agent = tls_agent(_tls(pki), _client_context(pki))
    assert https_get(agent.https + "/healthz", agent.context)[0] == 200
    open_files = len(os.listdir(f"/proc/{agent.proc.pid}/fd"))
    silent = socket.create_connection(("127.0.0.1", agent.port))  # connects, never says hello
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", agent.port)) as plain:
            plain.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            with contextlib.suppress(OSError):
                assert not plain.recv(100).startswith(b"HTTP")
    assert https_get(agent.https + "/metrics", agent.context)[0] == 200  # served while one handshake hangs
    silent.close()
    wait_until(lambda: len(os.listdir(f"/proc/{agent.proc.pid}/fd")) == open_files, timeout=10,
               what="every failed connection closed")


def test_basic_auth_asks_for_credentials_everywhere_but_healthz(pki, tls_agent):
    agent = tls_agent({**_tls(pki), "basic_auth_users": {"prometheus": HASH}}, _client_context(pki))
    for path in ("/metrics", "/api/v1/state", "/"):
        status, _, headers = https_get(agent.https + path, agent.context)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic"), path
    assert https_get(agent.https + "/metrics", agent.context, "prometheus", "wrong")[0] == 401
    assert https_get(agent.https + "/metrics", agent.context, "nobody", PASSWORD)[0] == 401
    assert https_get(agent.https + "/metrics", agent.context, "prometheus", "x" * 100)[0] == 401  # > 72 bytes
    status, body, _ = https_get(agent.https + "/metrics", agent.context, "prometheus", PASSWORD)
    assert status == 200 and b"gpuwatch_agent_info" in body
    assert https_get(agent.https + "/api/v1/state", agent.context, "prometheus", PASSWORD)[0] == 200
    assert https_get(agent.https + "/healthz", agent.context)[0] == 200  # probes carry no credentials


def test_client_certificates_are_required_and_verified_when_configured(pki, tls_agent):
    mutual = _client_context(pki, client_cert=True)
    agent = tls_agent(_tls(pki, client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(pki["ca.crt"])),
                      mutual)
    assert https_get(agent.https + "/metrics", mutual)[0] == 200
    # TLS 1.3: the server's refusal comes after the client's handshake, as an alert or a closed connection.
    with pytest.raises(OSError, match=r"CERTIFICATE_REQUIRED|EOF occurred in violation of protocol|reset by peer"):
        https_get(agent.https + "/metrics", _client_context(pki))


def test_min_version_refuses_older_clients(pki, tls_agent):
    agent = tls_agent(_tls(pki, min_version="TLS13"), _client_context(pki))
    with pytest.raises(urllib.error.URLError, match=r"(?i)version|alert|EOF occurred"):
        https_get(agent.https + "/metrics", _client_context(pki, maximum=ssl.TLSVersion.TLSv1_2))


def test_prometheus_scrapes_over_tls_with_basic_auth(pki, tls_agent, tmp_path):
    agent = tls_agent({**_tls(pki), "basic_auth_users": {"prometheus": HASH}}, _client_context(pki))
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{
            "job_name": "gpuwatch", "scheme": "https", "static_configs": [{"targets": [agent.https[8:]]}],
            "tls_config": {"ca_file": str(pki["ca.crt"])},
            "basic_auth": {"username": "prometheus", "password": PASSWORD},
        }],
    }))
    with (tmp_path / "prometheus.log").open("w") as log:
        prometheus = subprocess.Popen(
            [require_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "GOMAXPROCS": "1"})
        try:
            def scraped() -> list:
                url = f"http://127.0.0.1:{port}/api/v1/query?query=gpuwatch_collector_up"
                with urllib.request.urlopen(url, timeout=2) as response:
                    return json.loads(response.read())["data"]["result"]

            (sample,) = wait_until(scraped, timeout=30, what="prometheus scraping the agent over TLS")
            assert sample["metric"]["collector"] == "host" and sample["value"][1] == "1"
        finally:
            prometheus.terminate()
            prometheus.wait(15)


# -- credentials --------------------------------------------------------------------------------------

def _header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_verified_credentials_are_cached_and_unknown_users_cost_a_bcrypt_check(monkeypatch):
    calls = []
    checkpw = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda password, hashed: calls.append(hashed) or checkpw(password, hashed))
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert [auth.check(_header("prometheus", PASSWORD)) for _ in range(5)] == [True] * 5
    assert auth.check(_header("prometheus", "wrong")) is False
    assert auth.check(_header("prometheus", "wrong")) is False
    assert len(calls) == 2  # once per distinct (user, password), not once per request
    assert auth.check(_header("intruder", PASSWORD)) is False
    assert len(calls) == 3 and calls[-1] != HASH.encode()  # a dummy hash, so timing says nothing
    for bad in (None, "", "Bearer abc", "Basic !!!", "Basic " + base64.b64encode(b"no-colon").decode()):
        assert auth.check(bad) is False
    assert len(calls) == 3


def test_the_cache_is_bounded():
    auth = BasicAuth({"prometheus": HASH.encode()})
    for attempt in range(webconfig.CACHE_ENTRIES + 50):
        auth.check(_header("prometheus", f"guess-{attempt}"))
    assert len(auth._cache) == webconfig.CACHE_ENTRIES


# -- bad configs ------------------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key", "cert_flie": "x"}},
     "unknown key tls_server_config.cert_flie"),
    ({"basic_auth_user": {"a": HASH}}, "unknown key basic_auth_user"),
    ({"tls_server_config": {"cert_file": "missing.crt", "key_file": "tls.key"}}, "missing.crt does not exist"),
    ({"tls_server_config": {"key_file": "tls.key"}}, "missing cert_file"),
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "client.key"}}, "cannot load the certificate"),
    ({"basic_auth_users": {"prometheus": "plaintext"}}, "basic_auth_users.prometheus is not a bcrypt hash"),
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key", "min_version": "TLS14"}},
     "min_version 'TLS14' is not one of"),
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                            "client_auth_type": "RequireAnyClientCert"}}, "never verifies"),
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                            "client_auth_type": "RequireAndVerifyClientCert"}}, "needs client_ca_file"),
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key",
                            "cipher_suites": ["TLS_AES_128_GCM_SHA256"]}}, "cipher_suites is not supported"),
    ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "invalid value 'allow'"),
    ({"http_server_config": {"headers": {"Server": "x"}}}, "'Server' cannot be configured"),
    (["a list"], "the file must be a mapping"),
    ({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key", "min_version": ["TLS12"]}},
     "tls_server_config.min_version must be a string"),
    ({"http_server_config": {"http2": "yes"}}, "http_server_config.http2 must be a boolean"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_a_bad_config_is_one_clear_line_and_exit_status_1(pki, config, message):
    path = pki["ca.crt"].parent / "web.yml"  # relative names resolve against the config's directory
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["agent", "--web.config.file", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    (line,) = result.output.splitlines()
    assert line.startswith(f"Error: --web.config.file {path}: ") and message in line, line


def test_invalid_yaml_and_a_missing_file_fail_before_anything_starts(tmp_path):
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config: [unclosed\n")
    for path, message in ((bad, "not valid YAML"), (tmp_path / "absent.yml", "cannot read")):
        result = subprocess.run([sys.executable, "-m", "gpuwatch.cli.main", "agent", "--web.config.file", str(path)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        (line,) = result.stderr.splitlines()
        assert message in line, line


def test_an_empty_config_serves_plain_http():
    path = Path(os.devnull)
    config = webconfig.load(path)
    assert config.tls is None and config.auth is None and dict(config.headers) == {}
    with pytest.raises(WebConfigError, match="not both"):
        webconfig._parse({"tls_server_config": {"cert": "x", "cert_file": "y"}}, path.parent)
