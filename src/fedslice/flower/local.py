"""``fedslice deploy local``: a SuperLink and N SuperNodes on loopback, one run, then clean up.

::

    with LocalFederation(workdir, nodes=2, tls=True, auth=True) as fed:
        run_id, status = fed.run_app(app_dir, {"config": "/abs/exp.toml"}, timeout=1800)

Every process started here, and every process below it, is stopped by PID (SIGTERM, then SIGKILL),
also when the run fails or on Ctrl-C; every wait has a timeout. Flower's state (its
``FLWR_HOME``, connection config, certificates, keys, logs) lives in ``workdir``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedslice.flower.nodes import NUM_PARTITIONS, PARTITION_ID, DeploymentError
from fedslice.flower.settings import SERVER_ROOT_ENV

log = logging.getLogger(__name__)

CONNECTION = "fedslice-local"
STARTUP_TIMEOUT_S = 60.0
CLI_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


def flower_env(home: Path) -> dict[str, str]:
    """The environment of Flower's processes: this interpreter's bin on PATH (the SuperLink starts
    ``flower-superexec`` by name), a private ``FLWR_HOME``, no telemetry or update check."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    return env


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held together while picked)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


# --------------------------------------------------------------------------------------------
# Certificates and SuperNode keys
# --------------------------------------------------------------------------------------------

@dataclass
class Certificates:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S)
    except FileNotFoundError:
        raise DeploymentError("openssl is not installed: it makes the TLS certificates") from None
    except subprocess.CalledProcessError as e:
        raise DeploymentError(f"openssl {args[0]} failed: {e.stderr.strip()}") from None


def private_file(path: Path) -> Path:
    """Create ``path`` empty with mode 0600 (or make an existing one 0600), before a private key
    is written into it: the key is never readable by others, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    return path


def make_certificates(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
                      ) -> Certificates:
    """A self-signed CA and a server certificate for ``hosts`` signed by it (openssl, EC P-256);
    the private keys (``ca.key``, ``server.key``) are files of mode 0600."""
    folder.mkdir(parents=True, exist_ok=True)
    for key in ("ca.key", "server.key"):  # openssl writes into them, keeping the mode
        private_file(folder / key)
    san = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    (folder / "server.ext").write_text(f"subjectAltName={san}\n")
    _openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", "ca.key", cwd=folder)
    _openssl("req", "-new", "-x509", "-key", "ca.key", "-sha256", "-days", "365",
             "-subj", "/O=fedslice/CN=fedslice local CA", "-out", "ca.crt", cwd=folder)
    _openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", "server.key", cwd=folder)
    _openssl("req", "-new", "-key", "server.key", "-subj", f"/O=fedslice/CN={hosts[0]}",
             "-out", "server.csr", cwd=folder)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "365", "-sha256", "-extfile", "server.ext",
             "-out", "server.pem", cwd=folder)
    return Certificates(ca=folder / "ca.crt", cert=folder / "server.pem", key=folder / "server.key")


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC (P-384) key pair in OpenSSH format for SuperNode authentication: (private, public),
    like ``ssh-keygen -t ecdsa -b 384 -N "" -f NAME``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = private_file(folder / name), folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n")
    return private, public


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------

@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_process(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Process:
    """Start ``argv`` in a new session (Ctrl-C reaches only us: we stop it), output to
    ``log_dir/name.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as out:
        popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    log.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
    return Process(name, popen, log_path)


def descendants(pid: int) -> list:
    """Every process below ``pid`` (``psutil.Process``), or none once ``pid`` has ended."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def running(procs: list) -> list:
    """The processes of ``procs`` (``psutil.Process``) still running and not zombies; one that
    ends while it is asked counts as ended."""
    import psutil

    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def stop_processes(procs: list[Process], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop ``procs`` and every process below them, by PID: SIGTERM to all, then SIGKILL to those
    still running after ``timeout`` seconds.

    Flower starts some helpers in sessions of their own (the SuperLink's ``flower-superexec``), so
    descendants are listed by PID before the signal rather than reached by process group.
    """
    import psutil

    family: dict[str, list] = {p.name: descendants(p.pid) for p in procs}
    for proc in procs:
        if proc.alive():
            proc.popen.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop in %g s: killing it", proc.name, proc.pid, timeout)
            proc.popen.kill()
            proc.popen.wait(timeout)
    children = [c for p in procs for c in family[p.name]]
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    for proc in procs:
        log.info("stopped %s (pid %d) and %d process(es) it started", proc.name, proc.pid,
                 len(family[proc.name]))


# --------------------------------------------------------------------------------------------
# The federation
# --------------------------------------------------------------------------------------------

@dataclass
class LocalFederation:
    """A SuperLink and ``nodes`` SuperNodes on 127.0.0.1 (free ports), as a context manager.

    With ``simulation`` (``flwr run --federation-config`` values besides ``num-supernodes``, e.g.
    ``{"client-resources-num-cpus": 1}``) the SuperLink runs Flower's simulation engine (Ray)
    with ``nodes`` virtual SuperNodes instead, and no SuperNode process is started.
    """

    workdir: Path
    nodes: int
    tls: bool = False
    auth: bool = False
    node_config: dict[str, Any] = field(default_factory=dict)
    #: node index -> node config of that SuperNode only (e.g. one throttled node), over node_config
    node_configs: dict[int, dict[str, Any]] = field(default_factory=dict)
    simulation: dict[str, Any] | None = None
    #: the folders the ServerApp may read and write (``FEDSLICE_SERVER_ROOT``; none given: the
    #: environment's value, else the folder the SuperLink runs in)
    server_roots: list[Path] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.auth and not self.tls:
            raise DeploymentError("SuperNode authentication needs TLS (use --tls with --auth)")
        if self.simulation is not None and (self.tls or self.auth or self.node_config):
            raise DeploymentError("the simulation engine runs on one machine: no TLS, "
                                  "authentication or node config")
        self.workdir = Path(self.workdir).absolute()
        self.home = self.workdir / "flwr-home"
        self.log_dir = self.workdir / "logs"
        self.env = flower_env(self.home)
        if self.server_roots:
            self.env[SERVER_ROOT_ENV] = os.pathsep.join(str(Path(r).absolute()) for r in self.server_roots)
        self.port, *self.node_ports = free_ports(1 + (0 if self.simulation is not None else self.nodes))
        self.certs: Certificates | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.certs = make_certificates(self.workdir / "certificates")
        self._write_connection()
        self._start_superlink()
        if self.simulation is not None:
            return  # virtual SuperNodes, inside the SuperLink's simulation runtime
        keys = self._register_nodes() if self.auth else [None] * self.nodes
        for i, key in enumerate(keys):
            self._start_supernode(i, key)

    def _tls_args(self) -> list[str]:
        if not self.certs:
            return ["--insecure"]
        return ["--ssl-ca-certfile", str(self.certs.ca), "--ssl-certfile", str(self.certs.cert),
                "--ssl-keyfile", str(self.certs.key)]

    def _write_connection(self) -> None:
        """``$FLWR_HOME/config.toml`` with the connection ``fedslice-local``."""
        import tomli_w

        conn: dict[str, Any] = {"address": self.address}
        if self.certs:
            conn["root-certificates"] = str(self.certs.ca)
        else:
            conn["insecure"] = True
        text = tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: conn}})
        (self.home / "config.toml").write_text(text)

    def _start_superlink(self) -> None:
        argv = ["flower-superlink", *self._tls_args(), "--disable-runtime-dependency-installation",
                "--host", "127.0.0.1", "--port", str(self.port)]
        if self.simulation is not None:
            argv.append("--simulation")
        if self.auth:
            argv.append("--enable-supernode-auth")
        proc = start_process("superlink", argv, self.env, self.log_dir)
        self.processes.append(proc)
        self._wait_ready(proc)

    def _wait_ready(self, proc: Process, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Until the SuperLink answers ``/health`` (or exits, or ``timeout``)."""
        import httpx

        scheme = "https" if self.certs else "http"
        verify: Any = str(self.certs.ca) if self.certs else False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise DeploymentError(f"the SuperLink exited at start (code {proc.popen.returncode}):"
                                      f"\n{proc.log_tail()}")
            try:
                if httpx.get(f"{scheme}://{self.address}/health", verify=verify, timeout=2).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise DeploymentError(f"the SuperLink did not answer on {self.address} within {timeout:g} s:"
                              f"\n{proc.log_tail()}")

    def _register_nodes(self) -> list[Path]:
        """One key pair per SuperNode, each public key registered with ``flwr supernode register``."""
        keys = []
        for i in range(self.nodes):
            private, public = make_node_key(self.workdir / "keys", f"supernode-{i}")
            self.flwr("supernode", "register", str(public), CONNECTION)
            keys.append(private)
        return keys

    def _start_supernode(self, i: int, key: Path | None) -> None:
        config = {PARTITION_ID: i, NUM_PARTITIONS: self.nodes, **self.node_config,
                  **self.node_configs.get(i, {})}
        argv = ["flower-supernode", "--superlink", self.address, "--port", str(self.node_ports[i]),
                "--node-config", " ".join(f"{k}={json.dumps(v)}" for k, v in config.items()),
                *(["--root-certificates", str(self.certs.ca)] if self.certs else ["--insecure"]),
                *(["--auth-supernode-private-key", str(key)] if key else [])]
        self.processes.append(start_process(f"supernode-{i}", argv, self.env, self.log_dir))

    def kill_supernode(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` and every process below it (a machine that is gone: no
        goodbye to the SuperLink); it stays in :attr:`processes`, dead."""
        import psutil

        for proc in self.processes:
            if proc.name == f"supernode-{i}" and proc.alive():
                for p in [*descendants(proc.pid), psutil.Process(proc.pid)]:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                proc.popen.wait(STOP_TIMEOUT_S)

    def start_supernode(self, i: int) -> None:
        """(Re)start SuperNode ``i`` (without authentication); it joins with a new node id and
        the ServerApp maps it to its partition before the next round."""
        if self.auth:
            raise DeploymentError("restarting an authenticated SuperNode is not supported here")
        self._start_supernode(i, None)

    # -- the flwr CLI ------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> str:
        """Run ``flwr ARGS`` against this federation; its stdout, or a DeploymentError."""
        try:
            done = subprocess.run(["flwr", *args], env=self.env, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DeploymentError(f"flwr {' '.join(args)} did not finish in {timeout:g} s") from None
        if done.returncode != 0:
            raise DeploymentError(f"flwr {' '.join(args)} failed ({done.returncode}): "
                                  f"{(done.stdout + done.stderr).strip()[-2000:]}")
        return done.stdout

    def flwr_json(self, *args: str) -> dict[str, Any]:
        """``flwr ARGS --format json`` as a dict; a DeploymentError when it reports a failure
        (``flwr`` exits with 0 even then)."""
        out = self.flwr(*args, "--format", "json")
        try:
            data = json.loads(out[out.index("{"):])
        except ValueError:
            raise DeploymentError(f"flwr {' '.join(args)}: unexpected output {out.strip()!r}") from None
        if not data.get("success", True):
            raise DeploymentError(f"flwr {' '.join(args)} failed: "
                                  f"{str(data.get('error-message', data)).strip()}")
        return data

    def submit(self, app_dir: Path, run_config: Path) -> int:
        """``flwr run``: submit the app; returns the run id."""
        args = ["run", str(app_dir), CONNECTION, "--run-config", str(run_config)]
        if self.simulation is not None:
            values = {"num-supernodes": self.nodes, **self.simulation}
            args += ["--federation-config", " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())]
        data = self.flwr_json(*args)
        if "run-id" not in data:
            raise DeploymentError(f"flwr run did not start a run: {data}")
        return int(data["run-id"])

    def status(self, run_id: int) -> str:
        """The run's status as ``flwr ls`` shows it, e.g. ``running`` or ``finished:completed``."""
        runs = self.flwr_json("ls", CONNECTION, "--run-id", str(run_id)).get("runs", [])
        return str(runs[0].get("status", "unknown")) if runs else "unknown"

    def wait(self, run_id: int, timeout: float, poll: float = 5.0,
             finished_hint: Callable[[], bool] | None = None) -> str:
        """Until the run has finished (its final status) or ``timeout`` (then it is stopped).

        Each status check starts the ``flwr`` CLI (about a CPU second), so the status is read
        every ``poll`` seconds, or as soon as ``finished_hint()`` (a cheap check, e.g. for a file
        the ServerApp writes at its end) turns true. The first check comes ``poll`` seconds after
        the submission (a check at once finds the run just submitted: pending or starting).
        """
        deadline = time.monotonic() + timeout
        warned: set[str] = set()
        next_check = time.monotonic() + poll
        while time.monotonic() < deadline:
            hint = finished_hint is not None and finished_hint()
            if hint or time.monotonic() >= next_check:
                status = self.status(run_id)
                if status.startswith("finished"):
                    return status
                next_check = time.monotonic() + (1.0 if hint else poll)
            self._check_processes(warned)
            time.sleep(0.25 if hint else 0.5)
        try:
            self.flwr("stop", str(run_id), CONNECTION)
        except DeploymentError as e:
            log.warning("could not stop run %d: %s", run_id, e)
        raise DeploymentError(f"run {run_id} did not finish within {timeout:g} s (stopped)")

    def _check_processes(self, warned: set[str]) -> None:
        """A dead SuperLink ends the wait; a dead SuperNode is reported once (the ServerApp goes
        on without it)."""
        for proc in self.processes:
            if proc.alive() or proc.name in warned:
                continue
            if proc.name == "superlink":
                raise DeploymentError(f"the SuperLink exited (code {proc.popen.returncode}):\n"
                                      f"{proc.log_tail()}")
            warned.add(proc.name)
            log.warning("%s exited (code %s); see %s", proc.name, proc.popen.returncode, proc.log_path)

    def run_log(self, run_id: int) -> str:
        """The run's log (``flwr log RUN_ID --show``)."""
        return self.flwr("log", str(run_id), CONNECTION, "--show")

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every process started here and their descendants, by PID."""
        procs, self.processes = self.processes, []
        try:  # SuperNodes first (together): they sign off at the SuperLink
            stop_processes([p for p in procs if p.name != "superlink"])
            stop_processes([p for p in procs if p.name == "superlink"])
        except Exception as e:  # report, but never leave the caller's cleanup half done
            log.error("could not stop %s: %s", [(p.name, p.pid) for p in procs], e)
            for p in procs:
                if p.alive():
                    p.popen.kill()
