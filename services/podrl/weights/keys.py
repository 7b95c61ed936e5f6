"""The pod's weights key: only the pod's own trainer can hand its generator a manifest.

A ``WeightManifest`` names shared-memory segments and CUDA allocations that the generator then
reads as its policy, so a forged one poisons generation. Every manifest the trainer assembles
carries ``mac``: HMAC-SHA256, keyed by the pod's **weights key**, over the manifest's
deterministic protobuf encoding with ``mac`` left empty (prefixed with a purpose string, so the
key signs nothing else). The generator checks it before anything else, constant-time, and
refuses a missing or wrong one (``ManifestErrorKind.UNAUTHENTIC`` → ``PERMISSION_DENIED``).

The key is 32 random bytes, hex-encoded in a file whose path is ``PODRL_WEIGHTS_KEY_FILE``.
Only the pod's trainer and generator get that variable (and the file):

* ``podrl up``/``podrl run`` write a fresh key for the pod at every start
  (:func:`write_fresh_key_file`, mode 0600) and pass its path to the trainer and the generator;
* on Kubernetes the chart mounts a memory-backed ``emptyDir`` in those two containers only; the
  trainer creates the key there when it starts (:func:`load_trainer_key`: created once with
  ``O_EXCL``, read by every later start of the pod's trainer), the generator reads it when the
  first manifest arrives (the trainer made it before it could publish one, so nobody waits).

A key file is opened without following symlinks and must be a regular file that grants nothing
to group or others, owned by the reading user (a generator running as root accepts the owner
the pod gave it). Its owner is also the user whose shared-memory segments the generator opens
(``podrl.weights.shm``): the trainer's.

Without ``PODRL_WEIGHTS_KEY_FILE`` a trainer publishes manifests without a MAC (and says so at
start), and a generator refuses every manifest: weights cannot move until both have the key.
The MAC proves where a manifest comes from, not that it is new: re-sending an old manifest of
the pod's own trainer is stopped by the weight state (a version not newer is refused, a rollback
must go to an older version) and by the run secret (only the controller may call ApplyWeights).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from podrl.config import ConfigError
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind

log = logging.getLogger(__name__)

WEIGHTS_KEY_FILE_ENV = "PODRL_WEIGHTS_KEY_FILE"
"""Environment variable naming the pod's weights key file (not a run-config override)."""
KEY_BYTES = 32
_MAX_FILE_BYTES = 4096
_MAC_PURPOSE = b"podrl.v1.WeightManifest mac v1\0"


class WeightsKeyError(ConfigError):
    """The weights key file is missing, unsafe or malformed; the message names
    ``PODRL_WEIGHTS_KEY_FILE`` and the fix (a ConfigError: a service exits 2 with it)."""


def manifest_mac(secret: bytes, manifest: weights_pb2.WeightManifest) -> bytes:
    """HMAC-SHA256 of ``manifest`` with its ``mac`` field empty (deterministic encoding)."""
    unsigned = weights_pb2.WeightManifest()
    unsigned.CopyFrom(manifest)
    unsigned.ClearField("mac")
    payload = unsigned.SerializeToString(deterministic=True)
    return hmac.new(secret, _MAC_PURPOSE + payload, hashlib.sha256).digest()


@dataclass(frozen=True)
class WeightsKey:
    """The pod's weights key and the user that owns its file (the trainer's user)."""

    secret: bytes
    owner_uid: int

    def __repr__(self) -> str:  # never print the secret
        return f"WeightsKey(owner_uid={self.owner_uid})"

    def sign(self, manifest: weights_pb2.WeightManifest) -> None:
        """Set ``manifest.mac`` (after every other field is final)."""
        manifest.mac = manifest_mac(self.secret, manifest)

    def verify(self, manifest: weights_pb2.WeightManifest) -> None:
        """Raise ``ManifestError(UNAUTHENTIC)`` unless ``manifest.mac`` is this key's MAC."""
        if not manifest.mac:
            raise ManifestError(
                ManifestErrorKind.UNAUTHENTIC,
                "the manifest carries no mac; only the pod's own trainer (holding the pod's "
                f"weights key, {WEIGHTS_KEY_FILE_ENV}) can publish weights to this generator",
            )
        if not hmac.compare_digest(manifest.mac, manifest_mac(self.secret, manifest)):
            raise ManifestError(
                ManifestErrorKind.UNAUTHENTIC,
                "the manifest's mac does not match the pod's weights key: it was not "
                "published by this pod's trainer, or was changed after it was signed",
            )


def _parse(text: bytes, path: Path) -> bytes:
    try:
        secret = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: {path} does not hold a hex-encoded key; delete it (the "
            "trainer writes a new one) or write `openssl rand -hex 32` into it"
        ) from None
    if len(secret) < KEY_BYTES:
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: {path} holds {len(secret)} bytes, at least {KEY_BYTES} "
            "are needed (`openssl rand -hex 32`)"
        )
    return secret


def read_key_file(path: Path) -> WeightsKey:
    """The key in ``path``; raises FileNotFoundError if there is none yet, WeightsKeyError if
    the file is unsafe (a symlink, not a regular file, readable by group or others, owned by
    another user) or malformed."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: cannot open {path} ({err.strerror}); it must be a "
            "regular file of this user (symlinks are not followed)"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WeightsKeyError(f"{WEIGHTS_KEY_FILE_ENV}: {path} is not a regular file")
        if info.st_mode & 0o077:
            raise WeightsKeyError(
                f"{WEIGHTS_KEY_FILE_ENV}: {path} has mode {stat.S_IMODE(info.st_mode):o}; it "
                "must grant nothing to group or others (chmod 600)"
            )
        euid = os.geteuid()
        if euid != 0 and info.st_uid != euid:
            raise WeightsKeyError(
                f"{WEIGHTS_KEY_FILE_ENV}: {path} belongs to uid {info.st_uid}, not to this "
                f"service's user {euid}"
            )
        text = os.read(fd, _MAX_FILE_BYTES)
    finally:
        os.close(fd)
    return WeightsKey(_parse(text, path), info.st_uid)


def _write_new(path: Path) -> Path:
    """A new sibling of ``path`` with a fresh key, mode 0600 from its creation on."""
    fresh = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        fresh.unlink(missing_ok=True)
        raise
    os.close(fd)
    return fresh


def write_fresh_key_file(path: Path) -> WeightsKey:
    """Replace ``path`` with a new random key (``podrl up``: a new key at every start). The
    file is complete before its name appears: no reader sees it half written."""
    path = Path(path)
    fresh = _write_new(path)
    os.replace(fresh, path)
    return read_key_file(path)


def create_key_file(path: Path) -> WeightsKey:
    """The key in ``path``, written first if there is none (exactly once however many
    processes race: a complete file is linked into place, which fails if the name exists)."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        return read_key_file(path)
    fresh = _write_new(path)
    try:
        os.link(fresh, path)
    except FileExistsError:
        pass  # another process was first: use its key
    finally:
        fresh.unlink(missing_ok=True)
    return read_key_file(path)


def key_file_path(env: Mapping[str, str] | None = None) -> Path | None:
    value = (os.environ if env is None else env).get(WEIGHTS_KEY_FILE_ENV, "")
    return Path(value) if value else None


def load_trainer_key(env: Mapping[str, str] | None = None) -> WeightsKey | None:
    """The trainer's key (created if the file does not exist yet); None, with a warning, when
    ``PODRL_WEIGHTS_KEY_FILE`` is unset (manifests then carry no MAC and no generator takes
    them)."""
    path = key_file_path(env)
    if path is None:
        log.warning(
            "%s is not set: weight manifests are published without a mac, and generators "
            "refuse them",
            WEIGHTS_KEY_FILE_ENV,
        )
        return None
    try:
        return create_key_file(path)
    except OSError as err:
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: cannot create {path} ({err.strerror}); point it into a "
            "writable folder that only the pod's trainer and generator see"
        ) from None


class GeneratorKey:
    """The generator's view of the pod's key: read when the first manifest needs it (the
    trainer creates the file at its start, before it can publish), then kept."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.path = key_file_path(env)
        self._key: WeightsKey | None = None
        self._lock = threading.Lock()
        if self.path is None:
            log.warning(
                "%s is not set: this generator refuses every weight manifest (PERMISSION_DENIED)",
                WEIGHTS_KEY_FILE_ENV,
            )

    def get(self) -> WeightsKey:
        """The key; ``ManifestError(UNAUTHENTIC)`` if there is none (nothing can be verified)."""
        with self._lock:
            if self._key is not None:
                return self._key
            if self.path is None:
                raise ManifestError(
                    ManifestErrorKind.UNAUTHENTIC,
                    f"this generator has no weights key ({WEIGHTS_KEY_FILE_ENV} is not set), so "
                    "it cannot verify any manifest; give it and its pod's trainer the same key "
                    "file",
                )
            try:
                self._key = read_key_file(self.path)
            except FileNotFoundError:
                raise ManifestError(
                    ManifestErrorKind.UNAUTHENTIC,
                    f"no weights key at {self.path} ({WEIGHTS_KEY_FILE_ENV}) yet: the pod's "
                    "trainer writes it when it starts",
                ) from None
            except WeightsKeyError as err:
                raise ManifestError(ManifestErrorKind.UNAUTHENTIC, str(err)) from None
            return self._key

    def verify(self, manifest: weights_pb2.WeightManifest) -> WeightsKey:
        """Raise ``ManifestError(UNAUTHENTIC)`` unless ``manifest`` is signed by the pod's
        key; returns the key."""
        key = self.get()
        key.verify(manifest)
        return key
