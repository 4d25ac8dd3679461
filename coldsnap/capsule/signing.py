"""Capsule signatures, in cosign's formats, with `cryptography` for the keys and the ECDSA itself.

A signature says who vouches for a capsule manifest digest. ColdSnap writes what cosign 3 writes for
`cosign sign --key`: a Sigstore bundle (v0.3) holding a DSSE envelope over an in-toto statement whose subject is the
manifest digest, signed with ECDSA P-256 / SHA-256; so `cosign verify --key` accepts a capsule ColdSnap signed.
It verifies those bundles, and the simple-signing signatures of cosign 2 (a JSON payload naming the digest, its
signature in the layer annotation dev.cosignproject.cosign/signature), from keys given as PEM public keys
(cosign.pub). Nothing here trusts a key: that is the restore policy's job (coldsnap.capsule.trust).

Keys: the host's own signing key is made on first use in COLDSNAP_HOME/keys (capsule.key 0600, capsule.pub), or
COLDSNAP_SIGNING_KEY names a PEM private key (unencrypted PKCS#8 or SEC1)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from coldsnap.base.files import atomic_write, private_dir
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://sigstore.dev/cosign/sign/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
SIMPLESIGNING_MEDIA_TYPE = "application/vnd.dev.cosign.simplesigning.v1+json"
SIMPLESIGNING_ANNOTATION = "dev.cosignproject.cosign/signature"


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """cosign's key hint: base64 of the SHA-256 of the key's DER SubjectPublicKeyInfo."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


def load_public_key(path: str | os.PathLike) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"public key {path}: cannot be read as PEM ({e})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"public key {path}: not an ECDSA P-256 key (cosign's kind)")
    return key


@dataclass
class SigningKey:
    private: ec.EllipticCurvePrivateKey
    path: Path

    @property
    def public(self) -> ec.EllipticCurvePublicKey:
        return self.private.public_key()

    @property
    def id(self) -> str:
        return key_id(self.public)


def keys_dir() -> Path:
    return settings().home / "keys"


def host_public_key_path() -> Path:
    return keys_dir() / "capsule.pub"


def signing_key(create: bool = True) -> SigningKey | None:
    """COLDSNAP_SIGNING_KEY, else the host's own key (made on first use when create)."""
    given = settings().signing_key
    path = Path(given) if given else keys_dir() / "capsule.key"
    if not path.exists():
        if given:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"COLDSNAP_SIGNING_KEY={given}: no such file")
        if not create:
            return None
        private = ec.generate_private_key(ec.SECP256R1())
        private_dir(keys_dir())
        atomic_write(path, private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), 0o600)
        public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
        atomic_write(host_public_key_path(), public, 0o644)
        return SigningKey(private, path)
    try:
        loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"signing key {path}: cannot be read as an unencrypted PEM "
                            f"private key ({e})") from None
    if not isinstance(loaded, ec.EllipticCurvePrivateKey) or not isinstance(loaded.curve, ec.SECP256R1):
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"signing key {path}: not an ECDSA P-256 key")
    return SigningKey(loaded, path)


def host_public_key() -> ec.EllipticCurvePublicKey | None:
    """This host's own capsule key (what its captures are signed with), if it has one."""
    key = signing_key(create=False)  # COLDSNAP_SIGNING_KEY, when set, is loaded whatever `create` says
    return key.public if key else None


# --- DSSE / Sigstore bundles (cosign 3) --------------------------------------------------------------------------
def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def statement(digest: str) -> bytes:
    algorithm, _, hexdigest = digest.partition(":")
    return json.dumps({"_type": STATEMENT_TYPE, "subject": [{"digest": {algorithm: hexdigest}, "annotations": {}}],
                       "predicateType": PREDICATE_TYPE, "predicate": {}}, separators=(",", ":")).encode()


def sign(digest: str, key: SigningKey) -> dict:
    """A Sigstore bundle (as cosign 3 writes for `cosign sign --key`, without a transparency log entry)."""
    payload = statement(digest)
    sig = key.private.sign(pae(PAYLOAD_TYPE, payload), ec.ECDSA(hashes.SHA256()))
    return {"mediaType": BUNDLE_MEDIA_TYPE,
            "verificationMaterial": {"publicKey": {"hint": key.id}},
            "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                             "signatures": [{"sig": base64.b64encode(sig).decode()}]}}


def _signer(keys: dict[str, ec.EllipticCurvePublicKey], sigs: list[bytes], data: bytes) -> str | None:
    """The id of the first key among `keys` that made one of `sigs` over `data`."""
    for kid, key in keys.items():
        for sig in sigs:
            with contextlib.suppress(InvalidSignature):
                key.verify(sig, data, ec.ECDSA(hashes.SHA256()))
                return kid
    return None


def _b64(value, what: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string")
    return base64.b64decode(value, validate=True)


def verify_bundle(bundle: dict, digest: str, keys: dict[str, ec.EllipticCurvePublicKey]) -> str | None:
    """The id of the key among `keys` whose signature in `bundle` covers `digest`; None when none does."""
    try:
        env = bundle["dsseEnvelope"]
        if env.get("payloadType") != PAYLOAD_TYPE:
            return None
        payload = _b64(env["payload"], "payload")
        stmt = json.loads(payload)
        algorithm, _, hexdigest = digest.partition(":")
        if stmt.get("_type") != STATEMENT_TYPE or not any(
                (s.get("digest") or {}).get(algorithm) == hexdigest for s in stmt.get("subject") or []):
            return None
        sigs = [_b64(s["sig"], "sig") for s in env.get("signatures") or []]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return _signer(keys, sigs, pae(PAYLOAD_TYPE, payload))


def verify_simplesigning(signature: dict, digest: str, keys: dict[str, ec.EllipticCurvePublicKey]) -> str | None:
    """cosign 2's signature: its payload (simple signing JSON, base64) names the manifest digest; sig signs it."""
    try:
        payload = base64.b64decode(signature["payload"], validate=True)
        if json.loads(payload)["critical"]["image"]["docker-manifest-digest"] != digest:
            return None
        sig = _b64(signature.get("signature"), "signature")
    except (KeyError, TypeError, ValueError):
        return None
    return _signer(keys, [sig], payload)


# --- signatures kept beside the store ----------------------------------------------------------------------------
def signatures_dir(store_root: Path, digest: str) -> Path:
    return store_root / "signatures" / digest.replace(":", "-")


def save_signature(store_root: Path, digest: str, signature: dict) -> Path:
    """Keep a signature of `digest`: {"bundle": …} or {"simplesigning": {"payload": b64, "signature": b64}}."""
    data = json.dumps(signature, sort_keys=True).encode()
    path = signatures_dir(store_root, digest) / f"{hashlib.sha256(data).hexdigest()[:16]}.json"
    private_dir(path.parent)
    atomic_write(path, data, 0o644)
    return path


def saved_signatures(store_root: Path, digest: str) -> list[dict]:
    out = []
    for path in sorted(signatures_dir(store_root, digest).glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            value = json.loads(path.read_text())
            if isinstance(value, dict):
                out.append(value)
    return out


def verify_any(signatures: list[dict], digest: str, keys: dict[str, ec.EllipticCurvePublicKey]) -> str | None:
    """The id of a key among `keys` that signed `digest`, by any of the saved signatures."""
    for s in signatures:
        if isinstance(s.get("bundle"), dict):
            kid = verify_bundle(s["bundle"], digest, keys)
        elif isinstance(s.get("simplesigning"), dict):
            kid = verify_simplesigning(s["simplesigning"], digest, keys)
        else:
            continue
        if kid:
            return kid
    return None
